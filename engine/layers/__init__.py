"""Model building blocks in Megatron-LM's style, each owning a `weight_loader` that narrows a full
checkpoint tensor to this rank's shard, so model files read like Hugging Face's: `linear` (column-,
row-, QKV-, merged-column-parallel and replicated; only row-parallel layers communicate),
`vocab_embedding` (vocabulary-parallel embedding and LM head), `fused_moe` (FusedMoE: experts sliced
over the tensor-parallel ranks, dealt out whole under expert parallelism, or shared across
data-parallel replicas), `rotary_embedding`, `layernorm`, `activation`, and `quantization/` (the
methods that keep weights packed: GGUF blocks and round-to-nearest int8/int4). Attention is in
engine/attention/, the kernels these layers call in engine/kernels/.
"""
