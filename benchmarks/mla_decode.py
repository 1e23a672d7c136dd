"""MLA decode: llmctl's absorbed-weight decode over its paged latent cache vs transformers'
DeepseekV3Attention over its DynamicCache, one attention layer, the same weights.

The shape is tiny but wide: one layer of DeepSeek-V3's attention widths at tp=8 (16 heads,
q_lora_rank 1536, kv_lora_rank 512, rope 64, nope 128, v 128; hidden 2048 by default to keep
the projections, which both run alike, from hiding the attention). Each sequence has `--context`
tokens cached (both engines prefill the same random hidden states); a decode step is one new
token per sequence of a batch of `--batch`. transformers expands every cached latent through
kv_b_proj into keys and values at each step (its cache keeps the latent); llmctl folds kv_b_proj
into the query and the output and attends the latent rows themselves. Both run float32 on the
CPU with the same torch threads, timed step by step (the cache rolled back after each), best of
`--repeats` interleaved rounds. Prints the ms per step of both, the ratio, and the largest
difference of their outputs. With `--threads 1` the time is the thread's CPU time
(time.thread_time), which a busy shared machine does not inflate; else wall time.

    python benchmarks/mla_decode.py                           # contexts 512, 2048; batch 1, 8
    python benchmarks/mla_decode.py --context 4096 --batch 4 --threads 1
"""

from __future__ import annotations

import argparse
import os
import time


def build(args, context: int):
    """(transformers' attention module and its config, llmctl's module with the same
    weights)."""
    import torch
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    from llmctl.engine.attention.selector import get_attn_backend
    from llmctl.engine.config.model_shape import ModelShape
    from llmctl.engine.distributed import parallel_state
    from llmctl.engine.layers.rotary_embedding import RotaryEmbedding, rope_parameters
    from llmctl.engine.models.deepseek_v2 import DeepseekV2MLAAttention

    config = DeepseekV3Config(
        hidden_size=args.hidden, num_attention_heads=args.heads, q_lora_rank=1536,
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        num_hidden_layers=1, max_position_embeddings=context + 64, n_routed_experts=8,
        vocab_size=1024,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    theirs = DeepseekV3Attention(config, layer_idx=0).eval()
    for p in theirs.parameters():
        torch.nn.init.normal_(p, std=0.02)
    group = parallel_state.GroupCoordinator([0], 0)
    parallel_state.set_groups(group, group)
    shape = ModelShape.from_hf_config(config)
    rotary = RotaryEmbedding(64, shape.max_position_embeddings, rope_parameters(config), True)
    ours = DeepseekV2MLAAttention(config, shape, rotary).eval()
    state = theirs.state_dict()
    for name, param in ours.named_parameters():
        param.data.copy_(state[name])
    for module in ours.modules():
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
    ours.attn.backend = get_attn_backend(torch.device("cpu"), use_mla=True)
    return theirs, config, ours


def ours_cache(ours, batch: int, context: int, block_size: int = 16):
    """A paged latent cache for `batch` sequences of context + 1 tokens, bound to the layer;
    (block tables, the metadata of a prefill of `context` tokens each, of one decode step)."""
    import torch

    from llmctl.engine.attention.metadata import AttentionMetadata, PrefillChunk

    blocks = -(-(context + 1) // block_size)
    cache = torch.zeros(ours.attn.kv_cache_shape(batch * blocks, block_size))
    ours.attn.kv_cache = cache
    tables = torch.arange(batch * blocks).view(batch, blocks)
    positions = torch.arange(context)
    slots = (tables[:, positions // block_size] * block_size + positions % block_size).reshape(-1)
    prefill = AttentionMetadata(slot_mapping=slots, num_decodes=0)
    prefill.prefills = [PrefillChunk(i * context, context, context, 0, i) for i in range(batch)]
    prefill.prefill_block_tables = tables
    step = AttentionMetadata(
        slot_mapping=tables[:, context // block_size] * block_size + context % block_size,
        num_decodes=batch,
        decode_block_tables=tables,
        decode_seq_lens=torch.full((batch,), context + 1),
    )
    return prefill, step


def run(args, context: int, batch: int) -> tuple[float, float, float]:
    """(transformers ms/step, llmctl ms/step, max |difference| of their outputs)."""
    import torch
    from transformers import DynamicCache
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    from llmctl.engine.forward_context import set_forward_context

    theirs, config, ours = build(args, context)
    g = torch.Generator().manual_seed(1)
    past = torch.randn(batch, context, args.hidden, generator=g)
    new = torch.randn(batch, 1, args.hidden, generator=g)
    rope = DeepseekV3RotaryEmbedding(config)
    with torch.inference_mode():
        cache = DynamicCache(config=config)
        positions = torch.arange(context)[None].expand(batch, -1)
        theirs(past, rope(past, positions), None, cache=cache)
        step_rope = rope(new, torch.full((batch, 1), context))
        prefill, step = ours_cache(ours, batch, context)
        with set_forward_context(prefill):
            ours(torch.arange(context).repeat(batch), past.reshape(-1, args.hidden))
        step_positions = torch.full((batch,), context)

        def transformers_step():
            out = theirs(new, step_rope, None, cache=cache)[0]
            cache.crop(-1)  # the next step decodes the same token again
            return out.reshape(batch, -1)

        def llmctl_step():
            with set_forward_context(step):
                return ours(step_positions, new.reshape(batch, -1))

        diff = (transformers_step() - llmctl_step()).abs().max().item()
        clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
        best = {"transformers": float("inf"), "llmctl": float("inf")}
        for _ in range(args.repeats):  # interleaved: both see the same machine load
            for name, fn in (("transformers", transformers_step), ("llmctl", llmctl_step)):
                start = clock()
                fn()
                best[name] = min(best[name], clock() - start)
    return 1000 * best["transformers"], 1000 * best["llmctl"], diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=lambda s: [int(c) for c in s.split(",")],
                        default=[512, 2048])  # fmt: skip
    parser.add_argument("--batch", type=lambda s: [int(b) for b in s.split(",")], default=[1, 8])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = parser.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    clock = "thread CPU time" if torch.get_num_threads() == 1 else "wall time"
    print(f"MLA decode, one layer: hidden {args.hidden}, {args.heads} heads, q_lora 1536, "
          f"kv_lora 512, rope 64, nope 128, v 128; float32, {torch.get_num_threads()} threads "
          f"({os.cpu_count()} CPUs); best of {args.repeats}, {clock}")  # fmt: skip
    for context in args.context:
        for batch in args.batch:
            hf_ms, ours_ms, diff = run(args, context, batch)
            print(f"  context {context:5d}, batch {batch:2d}: transformers {hf_ms:8.2f} ms/step, "
                  f"llmctl {ours_ms:7.2f} ms/step, ratio {hf_ms / ours_ms:6.1f}x; "
                  f"outputs differ by {diff:.1e}")  # fmt: skip


if __name__ == "__main__":
    main()
