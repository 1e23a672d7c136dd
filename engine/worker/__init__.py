"""One rank. `worker.Worker` owns the rank's device, its slice of the model, its KV cache and a
ModelRunner, and is what executors call by method name (init_device, load_model,
determine_num_available_blocks, initialize_cache, execute_model); pipeline stages pass hidden states
to each other here. `model_runner.ModelRunner` turns a SchedulerOutput into device inputs gathered
from the persistent rows of `input_batch.InputBatch`, runs the model (or a CUDA graph of
`cuda_graph_runner`, or the CPU's fused decode stack) with the attention backend it chose once, and
samples with `sampler.Sampler`; the sampled ids come back to the host in one copy.
"""
