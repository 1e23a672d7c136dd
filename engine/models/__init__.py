"""Model families, written like Hugging Face's model code on the parallel layers: `llama` (Llama
2/3, Mistral, Qwen2, SmolLM2), `mixtral` and `qwen_moe` (the Llama decoder with a mixture of
experts), `gpt2` and `opt`; `utils` (pipeline-stage placeholders, the weight-loading loop) and
`registry` (the config's architecture name -> class). A model class is built for one pipeline stage,
`cls(hf_config, shape, shard)`, and provides `forward`, `compute_logits` and `load_weights`;
docs/architecture.md lists every place adding a family touches.
"""
