"""Micro-benchmark: the packed int4 / int8 group kernels against the engine's float32 dense path.

    .venv/bin/python benchmarks/quantized_matmul.py [--threads N] [--group-size 32]

For M=1 (decode) and M=64 (a batch), on the linear shapes of SmolLM2-135M and one 4096x4096:
float32 F.linear on the oneDNN-prepacked weight (what engine/layers/linear.py runs on the CPU),
our int4 and int8 kernels (kernels.pack_groups), and PyTorch's aten int4pack matmul with bf16
activations (its fast path). Prints the best-of-N time in ms and the weight bytes read per second.
For a long prefill (M=--prefill-rows, 8192 by default: one step of the GGUF benchmark's W3), on
SmolLM2-135M's layer shapes: int4 as the engine runs it (W expanded in large chunks, one GEMM
each) against the tiled path it replaced at that size (1 MiB tiles, one thread each).
"""

from __future__ import annotations

import argparse
import time

import torch

SHAPES = [(576, 576), (1536, 576), (576, 1536), (49152, 576), (4096, 4096)]  # (N, K)


def best_ms(fn, min_time: float = 0.3) -> float:
    fn()
    times, start = [], time.perf_counter()
    while time.perf_counter() - start < min_time or len(times) < 5:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--no-aten", action="store_true", help="skip aten's int4pack matmul")
    parser.add_argument("--prefill-rows", type=int, default=8192, help="M of the prefill case")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from llmctl.engine.layers.quantization import kernels
    from llmctl.engine.layers.quantization.kernels import kernel_available, pack_groups

    print(
        f"torch {torch.__version__}, {args.threads} threads, group {args.group_size}, "
        f"C++ kernel: {kernel_available()}"
    )
    g = args.group_size
    header = f"{'N x K':>12} {'M':>4} | {'kind':<14} {'ms':>8} {'GB/s':>7} {'vs f32':>7}"
    print(header)
    print("-" * len(header))
    torch.manual_seed(0)
    for n, k in SHAPES:
        w = torch.randn(n, k)
        prepacked = torch.ops.mkldnn._reorder_linear_weight(w, 64)
        s = torch.rand(n, k // g) + 0.01
        q4 = pack_groups(torch.randint(0, 16, (n, k), dtype=torch.uint8), s, -8 * s, 4, g)
        q8 = pack_groups(torch.randint(-127, 128, (n, k), dtype=torch.int8), s, None, 8, g)
        aten = None
        if not args.no_aten and n % 16 == 0:
            qi = torch.randint(0, 16, (n, k), dtype=torch.int32)
            aten = torch.ops.aten._convert_weight_to_int4pack_for_cpu(qi, 2)
            sz = torch.stack([s.T, torch.zeros_like(s).T], -1).contiguous().bfloat16()
        prefill = [args.prefill_rows] if n * k <= 1536 * 576 else []  # the model's layers only
        for m in (1, 64, *prefill):
            x = torch.randn(m, k)
            xb = x.bfloat16()
            runs = {
                "f32 dense": (
                    lambda x=x, w=prepacked: torch.ops.mkldnn._linear_pointwise(
                        x, w, None, "none", [], ""
                    ),
                    4 * n * k,
                ),
                "int4 ours": (lambda x=x, w=q4: w.matmul(x), q4.nbytes),
                "int8 ours": (lambda x=x, w=q8: w.matmul(x), q8.nbytes),
            }
            if m >= kernels.LARGE_BATCH:

                def tiled(x=x, w=q4):
                    chunked_from, kernels.LARGE_BATCH = kernels.LARGE_BATCH, 1 << 62
                    try:
                        return w.matmul(x)
                    finally:
                        kernels.LARGE_BATCH = chunked_from

                runs["int4 tiled"] = (tiled, q4.nbytes)
            if aten is not None and m < kernels.LARGE_BATCH:
                runs["int4 aten bf16"] = (
                    lambda x=xb, w=aten, sz=sz: torch.ops.aten._weight_int4pack_mm_for_cpu(
                        x, w, g, sz
                    ),
                    aten.numel() + sz.numel() * 2,
                )
            base = None
            for kind, (fn, nbytes) in runs.items():
                ms = best_ms(fn)
                base = base or ms
                print(
                    f"{n:>5} x {k:<5} {m:>4} | {kind:<14} {ms:8.3f} {nbytes / ms / 1e6:7.1f} "
                    f"{base / ms:6.2f}x"
                )


if __name__ == "__main__":
    main()
