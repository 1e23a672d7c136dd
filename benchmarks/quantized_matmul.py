"""Micro-benchmark: the packed int4 / int8 group kernels against the engine's float32 dense path.

    .venv/bin/python benchmarks/quantized_matmul.py [--threads N] [--group-size 32]

For M=1 (decode) and M=64 (a batch), on the linear shapes of SmolLM2-135M and one 4096x4096:
float32 F.linear on the oneDNN-prepacked weight (what engine/layers/linear.py runs on the CPU),
our int4 and int8 kernels (kernels.pack_groups), and PyTorch's aten int4pack matmul with bf16
activations (its fast path); on a CPU with bfloat16 tiles (AMX, AVX512-BF16) also bfloat16 rows
against the prepacked bfloat16 weight and our int4 kernel on them (the decode kernel at M=1, the
bfloat16 tiles at M=64). Prints the best-of-N time in ms and the weight bytes read per second.
For a long prefill (M=--prefill-rows, 8192 by default: one step of the GGUF benchmark's W3), on
SmolLM2-135M's layer shapes: int4 as the engine runs it (W expanded in large chunks, one GEMM
each) against the tiled path it replaced at that size (1 MiB tiles, one thread each); with
bfloat16 rows on Zen 4 that size runs on int8 activations ("int4 ours int8", int8_gemm.cpp).

    python benchmarks/quantized_matmul.py --device cuda

On a GPU: the engine's Triton group-quantized matmul (int4 with zeros, Q4_1's format; int8,
Q8_0's) with bfloat16 activations against cuBLAS's bfloat16 GEMM on the same weights dequantized
(what the float path runs), the whole weight expanded then cuBLAS per call (what the engine ran
above 64 rows before), and PyTorch's own int4 GPU kernel (tinygemm,
aten._weight_int4pack_mm) where this torch has it, on SmolLM2-135M's and Llama-3-8B's layer
shapes, M = 1, 16, 256, 2048; CUDA-event timings (triton.testing.do_bench, median).
"""

from __future__ import annotations

import argparse
import time

import torch

SHAPES = [(576, 576), (1536, 576), (576, 1536), (49152, 576), (4096, 4096)]  # (N, K)
CUDA_SHAPES = [(1536, 576), (49152, 576), (4096, 4096), (14336, 4096), (4096, 14336)]


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
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    if args.device == "cuda":
        return cuda_main(args)
    torch.set_num_threads(args.threads)
    from llmctl.engine.kernels.cpu import quantized_matmul as kernels
    from llmctl.engine.kernels.cpu.quantized_matmul import kernel_available, pack_groups
    from llmctl.engine.platform import cpu_path

    bf16_tiles = cpu_path().bf16_tiles
    print(
        f"torch {torch.__version__}, {args.threads} threads, group {args.group_size}, "
        f"C++ kernel: {kernel_available()}, {cpu_path().describe()}"
    )
    g = args.group_size
    header = f"{'N x K':>12} {'M':>4} | {'kind':<14} {'ms':>8} {'GB/s':>7} {'vs f32':>7}"
    print(header)
    print("-" * len(header))
    torch.manual_seed(0)
    for n, k in SHAPES:
        w = torch.randn(n, k)
        prepacked = torch.ops.mkldnn._reorder_linear_weight(w, 64)
        prepacked_bf16 = torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 64)
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
            if bf16_tiles:  # bfloat16 rows: the dense bfloat16 weight and our bfloat16 tiles
                runs["bf16 dense"] = (
                    lambda x=xb, w=prepacked_bf16: torch.ops.mkldnn._linear_pointwise(
                        x, w, None, "none", [], ""
                    ),
                    2 * n * k,
                )
                # from prefill_rows("int8") rows on Zen 4: int8 activations (int8_gemm.cpp)
                int8 = q4.prefill_kind(kernels._kernel()) == "int8"
                int8 = int8 and m >= kernels.prefill_rows("int8")
                label = "int4 ours int8" if int8 else "int4 ours bf16"
                runs[label] = (lambda x=xb, w=q4: w.matmul(x), q4.nbytes)
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


def cuda_main(args) -> None:
    import triton.testing

    from llmctl.engine.kernels.cpu.quantized_matmul import pack_groups
    from llmctl.engine.kernels.triton import triton_group_mm, triton_ops

    def _dequantize_then_cublas(w, x):
        k = w.in_features
        full = triton_group_mm.dequantize(w.qweight, w.scales, w.zeros, w.bits, g, k, x.dtype)
        return torch.nn.functional.linear(x, full)

    g, dev = args.group_size, torch.device("cuda")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, group {g}, bf16 activations")
    header = f"{'N x K':>13} {'M':>5} | {'kind':<16} {'us':>8} {'GB/s':>7} {'vs bf16':>7}"
    print(header)
    print("-" * len(header))
    torch.manual_seed(0)

    def ours(packed, x):
        z = packed.zeros
        return triton_ops.group_quantized_mm(x, packed.qweight, packed.scales, z, packed.bits, g)

    for n, k in CUDA_SHAPES:
        s = (torch.rand(n, k // g) * 0.01 + 0.001).half()
        q4 = pack_groups(torch.randint(0, 16, (n, k), dtype=torch.uint8), s, -8 * s, 4, g).to(dev)
        q8 = pack_groups(torch.randint(-127, 128, (n, k), dtype=torch.int8), s, None, 8, g).to(dev)
        w4 = q4.to("cpu").dequantize().to(dev, torch.bfloat16)
        tiny = _tinygemm(q4, w4, n, k, g)
        for m in (1, 16, 256, 2048):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            runs = {
                "bf16 cuBLAS": (lambda x=x, w=w4: torch.nn.functional.linear(x, w), 2 * n * k),
                "int4 ours": (lambda x=x, w=q4: ours(w, x), q4.nbytes),
                "int8 ours": (lambda x=x, w=q8: ours(w, x), q8.nbytes),
            }
            # what the engine ran above 64 rows before: the whole weight expanded per call
            runs["int4 deq+cuBLAS"] = (lambda x=x, w=q4: _dequantize_then_cublas(w, x), q4.nbytes)
            if tiny is not None:
                runs["int4 tinygemm"] = (lambda x=x, t=tiny: t(x), n * k // 2 + n * k // g * 4)
            base = None
            for kind, (fn, nbytes) in runs.items():
                us = 1e3 * triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
                base = base or us
                print(
                    f"{n:>6} x {k:<5} {m:>5} | {kind:<16} {us:8.1f} {nbytes / us / 1e3:7.0f} "
                    f"{base / us:6.2f}x"
                )
            if m == 1:  # the kernels agree with cuBLAS on these weights
                err = (ours(q4, x).float() - runs["bf16 cuBLAS"][0]().float()).abs().max().item()
                print(f"{'':>22}   int4 ours vs bf16 max abs difference {err:.3g}")


def _tinygemm(q4, w4, n: int, k: int, g: int):
    """PyTorch's CUDA int4 matmul on q4's weights, or None where this torch lacks it."""
    try:
        q = q4.to("cpu")
        nib = q.qweight.view(n, k // 32, 16)
        ints = torch.stack([nib & 15, nib >> 4], dim=2).reshape(n, k).to(torch.int32)
        # torch >= 2.5 takes [N, K / 2] uint8, even element in the high nibble (as torchao packs)
        pairs = (ints[:, ::2] << 4 | ints[:, 1::2]).to(torch.uint8)
        packed = torch.ops.aten._convert_weight_to_int4pack(pairs.cuda(), 8)
        scales = q.scales.float()
        zeros = q.zeros.float() + 8 * scales  # tinygemm: w = (q - 8) * scale + zero
        sz = torch.stack([scales.T, zeros.T], -1).contiguous().to("cuda", torch.bfloat16)

        def run(x):
            return torch.ops.aten._weight_int4pack_mm(x, packed, g, sz)

        x = torch.randn(4, k, device="cuda", dtype=torch.bfloat16)
        err = (run(x).float() - (x @ w4.T).float()).abs().max().item()
        if err > 1.0:
            print(f"tinygemm left out: its output differs by {err:.3g}")
            return None
        return run
    except Exception as e:  # noqa: BLE001 - an optional peer: say why and go on
        print(f"tinygemm left out: {type(e).__name__}: {str(e)[:200]}")
        return None


if __name__ == "__main__":
    main()
