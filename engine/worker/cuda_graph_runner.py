"""CudaGraphRunner: decode-only steps replayed from CUDA graphs captured at padded batch sizes.

A decode step launches a few hundred small kernels whose CPU launch cost exceeds their GPU time
at small batches; a CUDA graph replays them with one launch. Graphs are captured once, after the
KV cache exists, for batch sizes 1, 2, 4, 8, 16, 24, ... up to max_num_seqs (largest first, so
the smaller ones share its memory pool). A step of D decodes runs the graph of the next size up,
B >= D: the model runner pads its inputs to B rows (slot -1: no KV write; seq_len 0: no keys),
the runner copies them into this graph's static input tensors, replays, and samples from the
first D rows of the static output. Steps with a prefill chunk, more decodes than the largest
graph, pipeline parallelism, enforce_eager, or a mixture-of-experts model (its FusedMoE
groups tokens by expert into data-dependent shapes) run eagerly.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING

import torch

from llmctl.engine.attention.metadata import AttentionMetadata
from llmctl.engine.forward_context import set_forward_context

if TYPE_CHECKING:
    from llmctl.engine.attention.backends.base import AttentionBackend
    from llmctl.engine.config.engine_config import EngineConfig
    from llmctl.engine.worker.model_runner import ModelInputs, ModelRunner

logger = logging.getLogger("llmctl")

_CAPTURE_SIZES = (1, 2, 4, *range(8, 513, 8))


def graphs_enabled(config: EngineConfig, device: torch.device, backend: AttentionBackend) -> bool:
    return (
        device.type == "cuda"
        and not getattr(config.model_config, "enforce_eager", False)
        and config.parallel_config.pipeline_parallel_size == 1
        and not config.model_config.shape.num_experts
        and backend.supports_cuda_graphs  # the torch backend's index_copy_ writes padding slots
    )


def capture_sizes(max_num_seqs: int) -> list[int]:
    return [s for s in _CAPTURE_SIZES if s <= max_num_seqs] or [1]


class CudaGraphRunner:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.sizes = capture_sizes(runner.config.scheduler_config.max_num_seqs)
        self.table_width = runner.input_batch.max_blocks_per_req
        largest, device = self.sizes[-1], runner.device
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(largest, self.table_width, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(largest, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def padded_size(self, num_decodes: int, num_tokens: int) -> int | None:
        """The graph size a step of `num_decodes` decodes runs at; None: run it eagerly."""
        if num_decodes != num_tokens or num_decodes > self.sizes[-1]:
            return None
        return self.sizes[bisect.bisect_left(self.sizes, num_decodes)]

    def can_run(self, inputs: ModelInputs) -> bool:
        return not inputs.attn_metadata.prefills and inputs.input_ids.shape[0] in self.graphs

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info()[0]
        pool = None
        for size in reversed(self.sizes):
            md = self._metadata(size)
            args = (self.input_ids[:size], self.positions[:size], None)
            with set_forward_context(md):
                self.runner.model(*args)  # warm-up: Triton compiles, allocators settle
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool), set_forward_context(md):
                output = self.runner.model(*args)
            pool = graph.pool()
            self.graphs[size] = (graph, output)
        torch.cuda.synchronize()
        used = (free_before - torch.cuda.mem_get_info()[0]) / (1 << 20)
        logger.info(
            "Captured CUDA graphs for %d decode batch sizes (1 to %d) in %.1f s, %.0f MiB; "
            "--enforce-eager turns them off",
            len(self.sizes),
            self.sizes[-1],
            time.perf_counter() - start,
            used,
        )

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            num_decodes=size,
            decode_block_tables=self.block_tables[:size],
            decode_seq_lens=self.seq_lens[:size],
            sliding_window=self.runner.sliding_window,
        )

    def run(self, inputs: ModelInputs) -> torch.Tensor:
        """Replay the graph of the inputs' (padded) size; the hidden states [size, hidden]."""
        md = inputs.attn_metadata
        size = inputs.input_ids.shape[0]
        graph, output = self.graphs[size]
        self.input_ids[:size].copy_(inputs.input_ids)
        self.positions[:size].copy_(inputs.positions)
        self.slot_mapping[:size].copy_(md.slot_mapping)
        self.block_tables[:size].copy_(md.decode_block_tables)
        self.seq_lens[:size].copy_(md.decode_seq_lens)
        graph.replay()
        return output
