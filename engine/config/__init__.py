"""Configuration, torch-free so that `llmctl --help` and `llmctl plan` stay instant.
`engine_args.EngineArgs` is everything a user may set, each option declared once with its command
line (`options.OptionSpec`, which ServerConfig's fields use too), from which the CLI flags, the
`LLM(...)` keywords, a Ray Serve app's keys and the argv of the cluster's servers are derived;
`create_engine_config` resolves it into the frozen per-layer configs of `engine_config`
(ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, DeviceConfig in one EngineConfig),
validated once. `model_shape.ModelShape` is a model's sizes from a Hugging Face config or GGUF
metadata, read by the layers and the planner alike (`architectures` names the families it reads;
`model_catalog` types in popular models' configs); `hf_config_view` sends a config to worker
processes as plain data; `memory_profile` sizes the KV cache from a memory profile, measured by the
engine and estimated by `llmctl plan`.
"""
