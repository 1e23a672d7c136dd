"""On a GPU: the block-FP8 GEMM against cuBLAS bfloat16, and the MLA decode kernel's bandwidth.

FP8: llmctl's Triton W8A8 GEMM (kernels/triton/triton_fp8_gemm.py, the activations' per-token
group quantization included) against torch.mm on the same weights dequantized to bfloat16, on
DeepSeek-V3's linear shapes at tp=8 (q_b_proj, kv_a_proj_with_mqa, o_proj, an expert's gate_up
and down) for M = 1 .. 2048 rows; the median of CUDA-event timings. MLA: the absorbed decode
kernel (kernels/triton/triton_mla.py) over DeepSeek-V3's latent cache at 16 heads a rank
(576 bfloat16 values a token), its achieved bandwidth in GB/s (latent bytes read / time).

    python benchmarks/fp8_gemm_mla_cuda.py              # needs an NVIDIA GPU of sm_89 or newer
    python benchmarks/fp8_gemm_mla_cuda.py --rows 1,64 --contexts 4096 --batches 1,32
"""

from __future__ import annotations

import argparse
import sys

# DeepSeek-V3 at tp=8: (name, N, K)
SHAPES = [
    ("q_b_proj", 16 * 192, 1536),
    ("kv_a_proj_with_mqa", 576, 7168),
    ("o_proj", 7168, 16 * 128),
    ("expert gate_up", 2 * 2048, 7168),
    ("expert down", 7168, 2048),
]


def median_ms(repeats: int, fn, *args) -> float:
    """The median time of fn(*args) over `repeats` calls, in ms (CUDA events)."""
    import torch

    fn(*args)  # compile / warm up
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def fp8_gemm(args) -> None:
    import torch

    from llmctl.engine.kernels.triton.triton_fp8_gemm import fp8_block_mm
    from llmctl.engine.layers.quantization.fp8 import quantize_rows

    print("block-FP8 GEMM (Triton, W8A8) vs cuBLAS bfloat16, ms (median)")
    for name, n, k in SHAPES:
        weight = quantize_rows(torch.randn(n, k), (128, 128)).to("cuda")
        dense = weight.dequantize().to(torch.bfloat16)
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ours = median_ms(args.repeats, fp8_block_mm, x, weight.qweight, weight.scales, 128)
            cublas = median_ms(args.repeats, torch.mm, x, dense.t())
            print(f"  {name:20s} N={n:5d} K={k:5d} M={m:5d}: fp8 {ours:7.3f}, bf16 {cublas:7.3f}, "
                  f"ratio {cublas / ours:5.2f}x")  # fmt: skip


def mla_bandwidth(args) -> None:
    import torch

    from llmctl.engine.kernels.triton.triton_mla import mla_decode_attention

    print("MLA absorbed decode (Triton), 16 heads, kv_lora 512 + rope 64, bfloat16")
    for context in args.contexts:
        for batch in args.batches:
            blocks = -(-context // 16)
            cache = torch.randn(batch * blocks, 16, 576, device="cuda", dtype=torch.bfloat16)
            tables = torch.arange(batch * blocks, device="cuda").view(batch, blocks)
            lens = torch.full((batch,), context, device="cuda")
            q_latent = torch.randn(batch, 16, 512, device="cuda", dtype=torch.bfloat16)
            q_pe = torch.randn(batch, 16, 64, device="cuda", dtype=torch.bfloat16)
            ms = median_ms(
                args.repeats, mla_decode_attention, q_latent, q_pe, cache, tables, lens, 0.1
            )
            gb = batch * context * 576 * 2 / 1e9
            print(
                f"  context {context:6d}, batch {batch:3d}: {ms:7.3f} ms, {gb / ms * 1e3:7.1f} GB/s"
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    parser.add_argument("--rows", type=ints, default=[1, 16, 64, 256, 2048])
    parser.add_argument("--contexts", type=ints, default=[1024, 8192, 32768])
    parser.add_argument("--batches", type=ints, default=[1, 8, 64])
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("needs an NVIDIA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 1
    print(
        f"{torch.cuda.get_device_name()}, compute capability {torch.cuda.get_device_capability()}"
    )
    fp8_gemm(args)
    mla_bandwidth(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
