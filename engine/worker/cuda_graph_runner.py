"""CudaGraphRunner: steps replayed from CUDA graphs captured at padded sizes.

A decode step launches a few hundred small kernels whose CPU launch cost exceeds their GPU time
at small batches; a CUDA graph replays them with one launch. Graphs are captured once, after the
KV cache exists (largest first, so the smaller ones share its memory pool):
- decode graphs for batch sizes 1, 2, 4, 8, 16, 24, ... up to max_num_seqs. A step of D decodes
  runs the graph of the next size up, B >= D: the model runner pads its inputs to B rows (slot
  -1: no KV write; seq_len 0: no keys), the runner copies them into this graph's static input
  tensors, replays, and samples from the first D rows of the static output;
- mixed graphs, where the attention backend runs a step with a prefill chunk as one varlen
  kernel over all its sequences (Triton's), for 16, 32, ... 512 tokens (up to
  max_num_batched_tokens): a step of T tokens runs the next size up; its chunk metadata is
  padded to max_num_seqs chunks (the ones beyond hold no tokens), so the kernel's grid is the
  graph's. Online traffic that mixes a prefill chunk into the decodes keeps its graphs.
Longer steps, pipeline parallelism, enforce_eager, or a mixture-of-experts model (its FusedMoE
groups tokens by expert into data-dependent shapes) run eagerly.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING

import torch

from llmctl.engine.attention.metadata import AttentionMetadata, PrefillChunk
from llmctl.engine.forward_context import set_forward_context

if TYPE_CHECKING:
    from llmctl.engine.attention.backends.base import AttentionBackend
    from llmctl.engine.config.engine_config import EngineConfig
    from llmctl.engine.worker.model_runner import ModelInputs, ModelRunner

logger = logging.getLogger("llmctl")

_CAPTURE_SIZES = (1, 2, 4, *range(8, 513, 8))
_MIXED_SIZES = (16, 32, 64, 128, 256, 512)  # tokens of a step with a prefill chunk


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
        sc = runner.config.scheduler_config
        self.sizes = capture_sizes(sc.max_num_seqs)
        self.mixed_sizes: list[int] = []
        # Mixed steps under graphs with one KV cache group and one rope table (models with
        # sliding and full layers, or LongRoPE, run such steps eagerly).
        if (
            runner.attn_backend.unified_mixed_steps
            and runner.num_groups == 1
            and (runner.long_rope_threshold is None)
        ):
            self.mixed_sizes = [s for s in _MIXED_SIZES if s <= sc.max_num_batched_tokens]
        self.max_chunks = sc.max_num_seqs
        self.table_width = runner.input_batch.max_blocks_per_req
        largest, device = max(self.sizes[-1], *self.mixed_sizes, 1), runner.device
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        # per KV cache group
        groups = range(runner.num_groups)
        self.slot_mapping = [
            torch.full((largest,), -1, dtype=torch.int64, device=device) for _ in groups
        ]
        self.block_tables = [
            torch.zeros(largest, self.table_width, dtype=torch.int64, device=device) for _ in groups
        ]
        self.seq_lens = torch.zeros(largest, dtype=torch.int64, device=device)
        self.long_rope = None
        if runner.long_rope_threshold is not None:
            self.long_rope = torch.zeros(largest, dtype=torch.int64, device=device)
        # a mixed step's chunks: [max_chunks + 1] starts, [max_chunks] lengths, their tables
        chunks = self.max_chunks
        self.chunk_starts = torch.zeros(chunks + 1, dtype=torch.int64, device=device)
        self.chunk_seq_lens = torch.zeros(chunks, dtype=torch.int64, device=device)
        self.chunk_context_lens = torch.zeros(chunks, dtype=torch.int64, device=device)
        self.chunk_tables = torch.zeros(chunks, self.table_width, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.mixed_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def padded_size(self, num_decodes: int, num_tokens: int, num_reqs: int) -> int | None:
        """The graph size (rows of the inputs) a step runs at; None: run it eagerly."""
        if num_decodes == num_tokens:
            if num_decodes > self.sizes[-1]:
                return None
            return self.sizes[bisect.bisect_left(self.sizes, num_decodes)]
        if not self.mixed_sizes or num_tokens > self.mixed_sizes[-1] or num_reqs > self.max_chunks:
            return None
        return self.mixed_sizes[bisect.bisect_left(self.mixed_sizes, num_tokens)]

    def can_run(self, inputs: ModelInputs) -> bool:
        graphs = self.mixed_graphs if inputs.attn_metadata.prefills else self.graphs
        return inputs.input_ids.shape[0] in graphs

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info()[0]
        pool = None
        captures = [(self.mixed_graphs, s, self._mixed_metadata(s)) for s in self.mixed_sizes]
        captures += [(self.graphs, s, self._metadata(s)) for s in self.sizes]
        for graphs, size, md in sorted(captures, key=lambda c: -c[1]):  # largest first
            args = (self.input_ids[:size], self.positions[:size], None)
            with set_forward_context(md):
                self.runner.model(*args)  # warm-up: Triton compiles, allocators settle
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool), set_forward_context(md):
                output = self.runner.model(*args)
            pool = graph.pool()
            graphs[size] = (graph, output)
        torch.cuda.synchronize()
        used = (free_before - torch.cuda.mem_get_info()[0]) / (1 << 20)
        mixed = f" and {len(self.mixed_sizes)} mixed-step sizes" if self.mixed_sizes else ""
        logger.info(
            "Captured CUDA graphs for %d decode batch sizes (1 to %d)%s in %.1f s, %.0f MiB; "
            "--enforce-eager turns them off",
            len(self.sizes),
            self.sizes[-1],
            mixed,
            time.perf_counter() - start,
            used,
        )

    def _metadata(self, size: int) -> AttentionMetadata:
        groups = [
            AttentionMetadata(
                slot_mapping=slots[:size],
                num_decodes=size,
                decode_block_tables=tables[:size],
                decode_seq_lens=self.seq_lens[:size],
            )
            for slots, tables in zip(self.slot_mapping, self.block_tables, strict=True)
        ]
        md = groups[0]
        md.other_groups = tuple(groups[1:])
        if self.long_rope is not None:
            md.long_rope = self.long_rope[:size]
        return md

    def _mixed_metadata(self, size: int) -> AttentionMetadata:
        """A mixed step of `size` tokens, every sequence a chunk of the static chunk rows (at
        capture they hold no tokens: the kernel's programs return at once)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[0][:size],
            num_decodes=0,
            prefills=[PrefillChunk(0, 0, 0, 0, 0)],  # (host facts: the varlen kernel reads none)
            prefill_block_tables=self.chunk_tables,
            prefill_query_start_loc=self.chunk_starts,
            prefill_seq_lens=self.chunk_seq_lens,
            prefill_context_lens=self.chunk_context_lens,
            max_prefill_query_len=size,
        )

    def run(self, inputs: ModelInputs) -> torch.Tensor:
        """Replay the graph of the inputs' (padded) size; the hidden states [size, hidden]."""
        md = inputs.attn_metadata
        size = inputs.input_ids.shape[0]
        self.input_ids[:size].copy_(inputs.input_ids)
        self.positions[:size].copy_(inputs.positions)
        for g, slots in enumerate(self.slot_mapping):
            slots[:size].copy_(md.for_group(g).slot_mapping)
        if self.long_rope is not None:
            self.long_rope[:size].copy_(md.long_rope)
        # Only the columns the batch's longest sequence needs: the kernels read no further
        # than each sequence's length, so the older columns beyond are never read.
        if md.prefills:  # (one KV cache group: see mixed_sizes)
            graph, output = self.mixed_graphs[size]
            width = md.prefill_block_tables.shape[1]
            self.chunk_tables[:, :width].copy_(md.prefill_block_tables)
            self.chunk_starts.copy_(md.prefill_query_start_loc)
            self.chunk_seq_lens.copy_(md.prefill_seq_lens)
            self.chunk_context_lens.copy_(md.prefill_context_lens)
        else:
            graph, output = self.graphs[size]
            for g, tables in enumerate(self.block_tables):
                group_tables = md.for_group(g).decode_block_tables
                tables[:size, : group_tables.shape[1]].copy_(group_tables)
            self.seq_lens[:size].copy_(md.decode_seq_lens)
        graph.replay()
        return output
