"""The GPU's group-quantized matmul (engine/kernels/triton/triton_group_mm.py) over tile choices:
which tiles, K split and kernel form (tl.dot on 16-row tiles, or products summed in registers for
a few rows) are fastest for each number of rows, on a model's layer shapes, against cuBLAS on the
same weights dequantized to bfloat16. fused_tiles' choices come from this table.

    python benchmarks/group_mm_tiles.py --out DIR [--seconds 240] [--model Llama-3.1-8B]

Writes DIR/group_mm_tiles.json after every (rows, shape): per candidate the microseconds (CUDA
events, median), and per (rows, shape) the best one and fused_tiles' current one. Candidates that
give a wrong product (against the dequantized weights) are recorded as such, never as fastest.
Needs a GPU; bfloat16 activations, int4 weights with zeros (Q4_1's form), groups of 32.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

ROWS = (1, 4, 8, 64, 256)


def candidates(m: int) -> list[dict]:
    """Tile choices worth timing for m rows of x."""
    out = []
    if m <= 8:  # products summed in registers, one tile of m rows
        block_m = 1 << (m - 1).bit_length()
        for n, k, warps in itertools.product((16, 32, 64), (128, 256), (2, 4)):
            if block_m * n * k <= 8 * 64 * 256:
                out.append(dict(BLOCK_M=block_m, BLOCK_N=n, BLOCK_K=k, USE_DOT=False,
                                num_warps=warps, num_stages=3))  # fmt: skip
    if m <= 64:  # tensor-core tiles of 16 to 64 rows
        block_m = 16 if m <= 16 else 64
        for n, k, stages in itertools.product((32, 64, 128), (128, 256), (3, 4)):
            out.append(dict(BLOCK_M=block_m, BLOCK_N=n, BLOCK_K=k, USE_DOT=True, num_warps=4,
                            num_stages=stages))  # fmt: skip
    else:
        for bm, n, k, warps in itertools.product((64, 128), (64, 128, 256), (64, 128), (4, 8)):
            if bm * n <= 128 * 128 or warps == 8:
                out.append(dict(BLOCK_M=bm, BLOCK_N=n, BLOCK_K=k, USE_DOT=True, num_warps=warps,
                                num_stages=3))  # fmt: skip
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seconds", type=float, default=240.0)
    parser.add_argument("--model", default="Llama-3.1-8B")
    parser.add_argument("--dry-run", action="store_true", help="toy shapes on the CPU, interpreted")
    args = parser.parse_args()
    if args.dry_run:
        import os

        os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch
    import torch.nn.functional as F
    import triton.testing
    from gpu_check import _put_tree_on_path

    _put_tree_on_path()
    from llmctl.engine.config.model_catalog import find_in_catalog
    from llmctl.engine.kernels.cpu.quantized_matmul import pack_groups
    from llmctl.engine.kernels.triton.triton_group_mm import fused_tiles, group_mm

    if not torch.cuda.is_available() and not args.dry_run:
        print("group_mm_tiles: no GPU; nothing measured")
        return 2
    deadline = time.monotonic() + args.seconds
    shape = find_in_catalog(args.model).shape
    h, d = shape.hidden_size, shape.head_dim
    q, kv = shape.num_attention_heads * d, shape.num_kv_heads * d
    inter = shape.intermediate_size
    shapes = [(q + 2 * kv, h), (h, q), (2 * inter, h), (h, inter)]
    group, dev, dtype = 32, "cuda", torch.bfloat16
    if args.dry_run:
        shapes, dev, dtype = [(48, 128), (40, 256)], "cpu", torch.float32
    weights = {}
    for n, k in shapes:
        scales = (torch.rand(n, k // group) * 0.01 + 0.001).half()
        w = pack_groups(
            torch.randint(0, 16, (n, k), dtype=torch.uint8), scales, -8 * scales, 4, group
        )
        weights[(n, k)] = (w.to(dev), w.dequantize().to(dev, dtype))
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {
        "model": args.model,
        "group": group,
        "gpu": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
        "rows": {},
    }

    def bench(fn) -> float:
        if args.dry_run:
            start = time.perf_counter()
            fn()
            return 1e6 * (time.perf_counter() - start)
        return 1e3 * triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median")

    for m in ROWS:
        for n, k in shapes:
            if time.monotonic() > deadline:
                report["stopped"] = "the time was spent"
                break
            w, dense = weights[(n, k)]
            x = torch.randn(m, k, dtype=dtype, device=dev)
            want = F.linear(x.float(), dense.float())
            cell = {"dense_us": bench(lambda x=x, dense=dense: F.linear(x, dense)), "tried": []}
            current = fused_tiles(m, k, dtype)
            tries = [current, *candidates(m)]
            for tiles in tries[:3] if args.dry_run else tries:
                for split in (None, 1, 2, 4, 8) if m <= 64 else (None, 1, 2):
                    if time.monotonic() > deadline:
                        break

                    def run(tiles=tiles, split=split, x=x, w=w):
                        return group_mm(x, w.qweight, w.scales, w.zeros, 4, group, tiles, split)

                    row = {"tiles": {**tiles}, "split": split}
                    try:
                        err = (run().float() - want).abs().max().item()
                        row["max_abs_error"] = err
                        row["us"] = bench(run) if err < 0.05 * want.abs().max().item() else None
                    except Exception as exc:  # noqa: BLE001 - a tile that does not compile
                        row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    cell["tried"].append(row)
            timed = [r for r in cell["tried"] if r.get("us")]
            if timed:
                best = min(timed, key=lambda r: r["us"])
                now = next(r for r in cell["tried"] if r["tiles"] == current and r["split"] is None)
                cell["best"] = {**best, "x_dense": cell["dense_us"] / best["us"]}
                cell["current_us"] = now.get("us")
                print(f"m={m} {n}x{k}: dense {cell['dense_us']:.1f} us, current "
                      f"{now.get('us') or float('nan'):.1f} us, best {best['us']:.1f} us "
                      f"{best['tiles']} split {best['split']}", flush=True)  # fmt: skip
            report["rows"].setdefault(str(m), {})[f"{n}x{k}"] = cell
            (args.out / "group_mm_tiles.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
