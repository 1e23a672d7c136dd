"""ModelRunner: turns a SchedulerOutput into model inputs on the device, runs the model, samples.

Requests arrive whole once (NewRequestData) and then as diffs (CachedRequestData); the runner keeps
them in an InputBatch (persistent host rows: tokens, block table, sampling settings), updated in
place. A step's inputs are gathered from those rows with vectorised numpy into StagedBuffers and
copied to the device once each (pinned host memory on CUDA): input ids, positions, slot mapping,
decode and prefill block tables and lengths, logits indices, sampling tensors. Tokens of a step
are laid out decodes first, then prefill chunks, as the attention layer expects. The sampled ids
(and log-probabilities, when asked) come back to the host in one copy.

The KV cache follows the model's KVCacheLayout (config/kv_cache_layout.py): one tensor per layer
of the stage for a model whose layers are alike; for one mixing sliding-window and full
attention, tensors shared by the layers of different KV cache groups, each group with its own
block tables, slot mapping and step metadata.

On CUDA, decode-only steps replay CUDA graphs captured at padded batch sizes (CudaGraphRunner)
unless enforce_eager is set.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch

from llmctl.engine.attention.layer import Attention
from llmctl.engine.attention.metadata import AttentionMetadata, PrefillChunk
from llmctl.engine.attention.mla_layer import MLAAttention
from llmctl.engine.attention.selector import get_attn_backend
from llmctl.engine.config.engine_config import EngineConfig
from llmctl.engine.config.kv_cache_layout import KVCacheLayout
from llmctl.engine.config.rope_parameters import long_rope_threshold
from llmctl.engine.core.model_runner_output import ModelRunnerOutput
from llmctl.engine.core.scheduler_output import SchedulerOutput
from llmctl.engine.errors import ConfigError
from llmctl.engine.forward_context import set_forward_context
from llmctl.engine.models.utils import IntermediateTensors, layer_index
from llmctl.engine.platform import torch_dtype
from llmctl.engine.worker.input_batch import InputBatch, StagedBuffer
from llmctl.engine.worker.sampler import Sampler, SamplingMetadata, make_generator
from llmctl.engine.worker.sampling_state import SamplingState


def zeroed_kv_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
    """A zero-filled KV cache tensor. On the CPU it lives in an anonymous memory map, whose pages
    the kernel supplies already zeroed on first write: the cache costs no start-up time and no
    resident memory until blocks are used (torch.zeros writes all of it: seconds and the whole
    kv_cache_space_gib of RSS at start). Zeros, not torch.empty, because reads past a sequence's
    length (padded block tables, masked SDPA) must not meet NaN bit patterns."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    import math
    import mmap

    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # frombuffer holds a reference to the map: it is unmapped when the tensor is freed.
    return torch.frombuffer(pages, dtype=dtype).view(shape)


def _fused_decode(model: torch.nn.Module, backend):
    if not backend.runs_cpu_decode_kernel:
        return None
    from llmctl.engine.kernels.cpu.fused_decode import FusedDecode

    return FusedDecode.for_model(model, backend)


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens] int64, on the device
    positions: torch.Tensor  # [num_tokens] int64
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampled]: rows whose next token is sampled
    sampled_rows: np.ndarray  # [num_sampled] InputBatch rows of those requests
    num_decodes: int


class ModelRunner:
    def __init__(self, engine_config: EngineConfig, model: torch.nn.Module):
        self.config = engine_config
        self.model = model
        mc, sc = engine_config.model_config, engine_config.scheduler_config
        self.block_size = engine_config.cache_config.block_size
        self.dtype = torch_dtype(mc.dtype)
        self.device = torch.device(engine_config.device_config.device)
        self.vocab_size = mc.shape.vocab_size
        self.kv_layout = KVCacheLayout.for_shape(mc.shape, mc.max_model_len, self.block_size)
        self.num_groups = self.kv_layout.num_groups
        # LongRoPE (Phi-3): requests longer than this read the long factors' angles
        self.long_rope_threshold = long_rope_threshold(mc.hf_config)
        self.input_batch = InputBatch(
            sc.max_num_seqs, mc.max_model_len, self.block_size, self.num_groups
        )
        # Off the CPU: the input batch's block tables (one per KV cache group), kept on the
        # device (only new block ids are copied each step; a step's tables are gathered there).
        self._device_tables: list[torch.Tensor] | None = None
        self._buffers: dict[str, StagedBuffer] = {}
        self._copies_done = None  # CUDA: event after the last step's host-to-device copies
        self.sampler = Sampler(make_generator(self.device, mc.seed))
        self.sampling = SamplingState(self.input_batch, self.device, self.vocab_size, self._stage)
        use_mla = any(isinstance(m, MLAAttention) for m in model.modules())
        # once: the layers never choose
        self.attn_backend = get_attn_backend(self.device, use_mla=use_mla)
        self.fused_decode = _fused_decode(model, self.attn_backend)
        self.kv_caches: list[torch.Tensor] = []
        self.cuda_graphs = None  # CudaGraphRunner, once the KV cache exists (CUDA only)
        self._scratch_kv: list[torch.Tensor] | None = None  # execute_dummy_batch's KV block

    # -- KV cache ------------------------------------------------------------------------------

    def attention_layers(self) -> list[Attention | MLAAttention]:
        """The layers with a KV cache; each says its cache's shape (`kv_cache_shape`)."""
        return [m for m in self.model.modules() if isinstance(m, (Attention, MLAAttention))]

    def kv_cache_placement(self) -> list[tuple[Attention | MLAAttention, int, int]]:
        """(layer, its KV cache group, the cache tensor it uses) for this stage's attention
        layers; each tensor's layers share one shape (the layer's `kv_cache_shape`)."""
        named = [
            (n, m)
            for n, m in self.model.named_modules()
            if isinstance(m, (Attention, MLAAttention))
        ]
        if self.num_groups == 1:
            return [(layer, 0, i) for i, (_, layer) in enumerate(named)]
        indices = [layer_index(name, "layers") for name, _ in named]
        where = self.kv_layout.placement(min(indices), max(indices) + 1)
        placement = [(layer, *where[i]) for i, (_, layer) in zip(indices, named, strict=True)]
        shapes: dict[int, tuple[int, ...]] = {}
        for layer, _, tensor in placement:
            shape = shapes.setdefault(tensor, layer.kv_cache_shape(1, self.block_size))
            if shape != layer.kv_cache_shape(1, self.block_size):
                raise ConfigError(
                    "layers of different KV cache groups must share KV head counts and sizes "
                    "to share cache tensors",
                    "this model mixes attention kinds with different KV shapes; report it",
                )
        return placement

    def _kv_tensor_layers(self) -> list[Attention | MLAAttention]:
        """One layer of each KV cache tensor of this stage, in tensor order: its shape is the
        tensor's (kv_cache_shape)."""
        first: dict[int, Attention | MLAAttention] = {}
        for layer, _, tensor in self.kv_cache_placement():
            first.setdefault(tensor, layer)
        return [first[t] for t in sorted(first)]

    def kv_cache_bytes_per_block(self) -> int:
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        return sum(
            math.prod(layer.kv_cache_shape(1, self.block_size)) * itemsize
            for layer in self._kv_tensor_layers()
        )

    def weight_bytes(self) -> int:
        """Bytes of this rank's weights as loaded (before CPU repacking)."""
        return self.model.loaded_weight_bytes

    def make_empty_intermediate_tensors(self, num_tokens: int) -> IntermediateTensors:
        """Buffers for the hidden states this stage receives from the previous one."""
        shape = (num_tokens, self.model.hidden_size)
        return {
            key: torch.empty(shape, dtype=self.dtype, device=self.device)
            for key in self.model.intermediate_keys
        }

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = [
            zeroed_kv_cache(
                layer.kv_cache_shape(num_blocks, self.block_size), self.dtype, self.device
            )
            for layer in self._kv_tensor_layers()
        ]
        for layer, group, tensor in self.kv_cache_placement():
            layer.bind(self.kv_caches[tensor], self.attn_backend, group)

    def capture_cuda_graphs(self) -> None:
        """CUDA, unless enforce_eager: capture the decode graphs (after the KV cache exists)."""
        from llmctl.engine.worker.cuda_graph_runner import CudaGraphRunner, graphs_enabled

        if graphs_enabled(self.config, self.device, self.attn_backend):
            self.cuda_graphs = CudaGraphRunner(self)
            self.cuda_graphs.capture()

    # -- one step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(
        self,
        scheduler_output: SchedulerOutput,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> ModelRunnerOutput:
        """Run one step. The output holds the sampled tokens on the last pipeline stage's
        tp_rank 0, the hidden states for the next stage on other stages, and nothing on the
        other tensor-parallel ranks."""
        self._update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput()
        inputs = self._prepare_inputs(scheduler_output)
        hidden = self._forward(inputs, intermediate_tensors)
        if not self.model.shard.is_last:
            return ModelRunnerOutput(intermediate_tensors=hidden)
        if not len(inputs.sampled_rows):
            return ModelRunnerOutput()
        logits = self.model.compute_logits(hidden.index_select(0, inputs.logits_indices))
        if logits is None:
            return ModelRunnerOutput()  # another tensor-parallel rank samples
        md = self.sampling.metadata(inputs.sampled_rows)
        self._end_staging()  # again: the sampling tensors' copies read host buffers too
        sampled, stats = self.sampler.sample(logits, md)
        self.sampling.record(md, sampled)
        tokens, logprobs = self.sampler.to_host(sampled, stats, md.num_logprobs)  # one copy
        output = ModelRunnerOutput()
        req_ids = self.input_batch.req_ids
        for row, token, lp in zip(inputs.sampled_rows.tolist(), tokens, logprobs, strict=True):
            output.sampled_token_ids[req_ids[row]] = token
            if lp is not None:
                output.logprobs[req_ids[row]] = lp
        return output

    def _forward(self, inputs: ModelInputs, intermediate_tensors: IntermediateTensors | None):
        graphs = self.cuda_graphs
        if graphs is not None and graphs.can_run(inputs):
            return graphs.run(inputs)
        with set_forward_context(inputs.attn_metadata):
            if self.fused_decode is not None:  # a small CPU decode step: its layers in one call
                out = self.fused_decode(inputs.input_ids, inputs.positions, intermediate_tensors)
                if out is not None:
                    return out
            return self.model(inputs.input_ids, inputs.positions, intermediate_tensors)

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in so.finished_req_ids:
            batch.remove_request(req_id)
            self.sampling.remove_request(req_id)
        for new in so.scheduled_new_reqs:
            self.sampling.add_request(new.req_id, new.sampling_params)
            batch.add_request(
                new.req_id,
                new.token_ids,
                new.num_prompt_tokens,
                new.sampling_params,
                new.block_ids,
                new.num_computed_tokens,
                self.vocab_size,
            )
        for cached in so.scheduled_cached_reqs:
            row = batch.row_of[cached.req_id]
            batch.append_tokens(row, cached.new_token_ids)
            batch.append_blocks(row, cached.new_block_ids)
            batch.num_computed_tokens[row] = cached.num_computed_tokens

    # -- inputs ----------------------------------------------------------------------------------

    def buffer(self, name: str, size: int, dtype: torch.dtype = torch.int64) -> StagedBuffer:
        """The named staging buffer, at least `size` long (grown, never shrunk)."""
        buf = self._buffers.get(name)
        if buf is None or buf.host.numel() < size:
            old = 0 if buf is None else buf.host.numel()
            buf = StagedBuffer(max(size, 2 * old, 16), dtype, self.device)
            self._buffers[name] = buf
        return buf

    def _stage(self, name: str, values: np.ndarray, dtype: torch.dtype = torch.int64):
        """Copy `values` (flat) to the device through the named buffer; the device view."""
        n = values.size
        buf = self.buffer(name, n, dtype)
        buf.np[:n] = values.reshape(-1)
        return buf.copy(n)

    def _begin_staging(self) -> None:
        # The last step's asynchronous copies read the pinned host buffers: let them finish
        # before this step overwrites them.
        if self._copies_done is not None:
            self._copies_done.synchronize()
            self._copies_done = None

    def _end_staging(self) -> None:
        if self.device.type == "cuda":
            self._copies_done = torch.cuda.Event()
            self._copies_done.record()

    def _prepare_inputs(self, so: SchedulerOutput) -> ModelInputs:
        batch, bs = self.input_batch, self.block_size
        scheduled = so.num_scheduled_tokens
        # Decodes (one token) first, then prefill chunks.
        order = [r for r, n in scheduled.items() if n == 1]
        num_decodes = len(order)
        order += [r for r, n in scheduled.items() if n > 1]
        rows = np.fromiter((batch.row_of[r] for r in order), np.int64, len(order))
        num_new = np.fromiter((scheduled[r] for r in order), np.int64, len(order))
        ends = np.cumsum(num_new)  # [num_reqs] end of each request's tokens in the layout
        total = int(ends[-1])
        computed = batch.num_computed_tokens[rows]
        seq_lens = computed + num_new
        # Token i of request j sits at position computed[j] + (i - start[j]).
        token_req = np.repeat(rows, num_new)
        positions = np.arange(total) + np.repeat(computed - (ends - num_new), num_new)
        sampled = np.flatnonzero(seq_lens >= batch.num_tokens[rows])
        batch.num_computed_tokens[rows] = seq_lens

        self._begin_staging()
        self._sync_block_tables()
        graphs = self.cuda_graphs
        pad_to = None
        if graphs is not None:
            pad_to = graphs.padded_size(num_decodes, total, len(rows))
        # With a prefill chunk, a unified backend takes every sequence as a chunk.
        mixed = num_decodes < len(rows)
        first_chunk = 0 if mixed and self.attn_backend.unified_mixed_steps else num_decodes
        groups = []
        for g, table in enumerate(batch.block_tables):
            slots = table[token_req, positions // bs] * bs + positions % bs
            md = AttentionMetadata(
                slot_mapping=self._stage_padded(f"slot_mapping.{g}", slots, pad_to, -1),
                # a padded decode step's rows are all decodes (the padding ones see no keys)
                num_decodes=pad_to if pad_to is not None and not mixed else first_chunk,
            )
            if first_chunk:
                d_rows, d_lens = rows[:num_decodes], seq_lens[:num_decodes]
                # as wide as the batch's longest sequence needs (CUDA-graph padding rows read
                # row 0's table with seq_len 0: nothing)
                width = int(-(-d_lens.max() // bs))
                if pad_to is not None and pad_to > num_decodes:
                    d_rows = np.concatenate([d_rows, np.zeros(pad_to - num_decodes, np.int64)])
                md.decode_block_tables = self._block_tables("decode_block_tables", g, d_rows, width)
                if g == 0:
                    md.decode_seq_lens = self._stage_padded("decode_seq_lens", d_lens, pad_to, 0)
            if mixed:
                chunks = graphs.max_chunks if pad_to is not None else None  # a graph's static rows
                self._prefill_metadata(
                    md, g, rows, num_new, seq_lens, computed, first_chunk, chunks
                )
                if pad_to is not None:
                    md.max_prefill_query_len = pad_to  # the graph's tiles
            groups.append(md)
        md = self._join_groups(groups)
        if self.long_rope_threshold is not None:
            long_rope = np.repeat(batch.num_tokens[rows] > self.long_rope_threshold, num_new)
            md.long_rope = self._stage_padded("long_rope", long_rope.astype(np.int64), pad_to, 0)
        inputs = ModelInputs(
            input_ids=self._stage_padded(
                "input_ids", batch.token_ids[token_req, positions], pad_to, 0
            ),
            positions=self._stage_padded("positions", positions, pad_to, 0),
            attn_metadata=md,
            logits_indices=self._stage("logits_indices", ends[sampled] - 1),
            sampled_rows=rows[sampled],
            num_decodes=num_decodes,
        )
        self._end_staging()
        return inputs

    def _sync_block_tables(self) -> None:
        """Off the CPU: write the block ids the input batch gained into the device's block
        tables (a whole table is copied only when it is made, or grows with the batch)."""
        batch = self.input_batch
        if self.device.type == "cpu":
            batch.new_blocks.clear()
            return
        tables = self._device_tables
        if tables is None or tables[0].shape[0] != batch.block_tables[0].shape[0]:
            self._device_tables = [torch.from_numpy(t).to(self.device) for t in batch.block_tables]
            batch.new_blocks.clear()
            return
        news, batch.new_blocks = batch.new_blocks, []
        for g, table in enumerate(tables):
            mine = [(row, start, ids) for group, row, start, ids in news if group == g]
            if not mine:
                continue
            rows = np.concatenate([np.full(len(ids), row, np.int64) for row, _, ids in mine])
            cols = np.concatenate([np.arange(start, start + len(ids)) for _, start, ids in mine])
            ids = np.concatenate([np.asarray(ids, np.int64) for _, _, ids in mine])
            index = (
                self._stage(f"new_block_rows.{g}", rows),
                self._stage(f"new_block_cols.{g}", cols),
            )
            table.index_put_(index, self._stage(f"new_block_ids.{g}", ids))

    def _block_tables(self, name: str, group: int, rows: np.ndarray, width: int) -> torch.Tensor:
        """[len(rows), width] int64: KV cache group `group`'s block tables of these input-batch
        rows, gathered on the device from its block table (on the CPU, read from the host's)."""
        if self._device_tables is None:
            tables = self.input_batch.block_tables[group][rows, :width]
            return self._stage(f"{name}.{group}", tables).view(len(rows), width)
        rows_on_device = self._stage(f"{name}_rows.{group}", rows)
        return self._device_tables[group][:, :width].index_select(0, rows_on_device)

    def _stage_padded(self, name: str, values: np.ndarray, pad_to: int | None, fill: int):
        """_stage, with rows beyond len(values) set to `fill` up to pad_to rows (CUDA graphs)."""
        if pad_to is None or pad_to == len(values):
            out = self._stage(name, values)
        else:
            row = values[0].size if values.ndim > 1 else 1
            buf = self.buffer(name, pad_to * row)
            buf.np[: values.size] = values.reshape(-1)
            buf.np[values.size : pad_to * row] = fill
            out = buf.copy(pad_to * row)
        return out.view(-1, values.shape[1]) if values.ndim > 1 else out

    @staticmethod
    def _join_groups(groups: list[AttentionMetadata]) -> AttentionMetadata:
        """Group 0's metadata, holding the others; what all groups share is group 0's."""
        first = groups[0]
        shared = ("decode_seq_lens", "prefills", "prefill_query_start_loc", "prefill_seq_lens")
        shared += ("prefill_context_lens", "max_prefill_query_len", "masks")
        for md in groups[1:]:
            for name in shared:
                setattr(md, name, getattr(first, name))
        first.other_groups = tuple(groups[1:])
        return first

    def _prefill_metadata(
        self, md, group, rows, num_new, seq_lens, computed, num_decodes, pad_chunks=None
    ) -> None:
        """The chunks' metadata in KV cache group `group`: rows from `num_decodes` on (all of
        them on a unified backend). `pad_chunks`: a CUDA graph's chunk rows (the rows beyond hold
        no tokens)."""
        bs = self.block_size
        p_rows, p_new = rows[num_decodes:], num_new[num_decodes:]
        p_lens, p_ctx = seq_lens[num_decodes:], computed[num_decodes:]
        width = int(-(-p_lens.max() // bs))
        starts = np.concatenate(([0], np.cumsum(p_new)))
        table_rows, padded_starts = p_rows, starts
        if pad_chunks is not None and pad_chunks > len(p_rows):
            extra = pad_chunks - len(p_rows)
            table_rows = np.concatenate([p_rows, np.zeros(extra, np.int64)])
            padded_starts = np.concatenate([starts, np.full(extra, starts[-1])])
        md.prefill_block_tables = self._block_tables(
            "prefill_block_tables", group, table_rows, width
        )
        if group:
            return  # the rest is shared, group 0's
        md.prefill_query_start_loc = self._stage("prefill_query_start_loc", padded_starts)
        md.prefill_seq_lens = self._stage_padded("prefill_seq_lens", p_lens, pad_chunks, 0)
        md.prefill_context_lens = self._stage_padded("prefill_context_lens", p_ctx, pad_chunks, 0)
        md.max_prefill_query_len = int(p_new.max())
        md.prefills = [
            PrefillChunk(num_decodes + int(s), int(n), int(length), int(ctx), i)
            for i, (s, n, length, ctx) in enumerate(
                zip(starts[:-1], p_new, p_lens, p_ctx, strict=True)
            )
        ]

    # -- a dummy batch (data-parallel replicas in lockstep) ---------------------------------------

    @torch.inference_mode()
    def execute_dummy_batch(self) -> None:
        """One token of no request through the model: a data-parallel replica with nothing to
        run this step runs it, so that its MoE layers meet the other replicas' in their
        collectives (engine/dp/lockstep.py). Its key and value go to a scratch block, not the
        KV cache; nothing is sampled."""
        layers = self.attention_layers()
        if self._scratch_kv is None:
            self._scratch_kv = [
                zeroed_kv_cache(layer.kv_cache_shape(1, self.block_size), self.dtype, self.device)
                for layer in layers
            ]
        bound = [layer.kv_cache for layer in layers]
        self._begin_staging()
        input_ids, positions, md, _ = self._prefill_only_inputs(np.ones(1, np.int64))
        self._end_staging()
        groups = [layer.kv_cache_group for layer in layers]
        for layer, scratch, group in zip(layers, self._scratch_kv, groups, strict=True):
            layer.bind(scratch, self.attn_backend, group)
        try:
            with set_forward_context(md):
                self.model(input_ids, positions, None)
        finally:
            for layer, cache, group in zip(layers, bound, groups, strict=True):
                layer.bind(cache, self.attn_backend, group)

    def _prefill_only_inputs(self, lens: np.ndarray):
        """(input_ids, positions, AttentionMetadata, ends) of prefills of `lens` tokens with no
        context, token id 0, every key and value written to slot 0."""
        num_tokens = int(lens.sum())
        ends = np.cumsum(lens)
        starts = ends - lens
        positions = np.arange(num_tokens) - np.repeat(starts, lens)
        md = AttentionMetadata(
            slot_mapping=self._stage("slot_mapping.0", np.zeros(num_tokens, np.int64)),
            num_decodes=0,
        )
        width = int(-(-lens.max() // self.block_size))
        md.prefill_block_tables = self._stage(
            "prefill_block_tables", np.zeros(len(lens) * width, np.int64)
        ).view(len(lens), width)
        md.prefill_query_start_loc = self._stage(
            "prefill_query_start_loc", np.concatenate(([0], ends))
        )
        md.prefill_seq_lens = self._stage("prefill_seq_lens", lens)
        md.prefill_context_lens = self._stage("prefill_context_lens", np.zeros_like(lens))
        md.max_prefill_query_len = int(lens.max())
        md.prefills = [
            PrefillChunk(int(s), int(n), int(n), 0, i)
            for i, (s, n) in enumerate(zip(starts, lens, strict=True))
        ]
        # every group writes slot 0 and reads block 0 alike
        md = self._join_groups([md] + [dataclasses.replace(md) for _ in range(1, self.num_groups)])
        input_ids = self._stage("input_ids", np.zeros(num_tokens, np.int64))
        return input_ids, self._stage("positions", positions), md, ends

    # -- memory profiling --------------------------------------------------------------------------

    @torch.inference_mode()
    def profile_run(self) -> None:
        """A forward at max_num_batched_tokens tokens, split over max_num_seqs prefills, and
        sampling for each: the peak activation memory the engine can reach, measured by the
        worker before it sizes the KV cache. Uses a one-block KV cache, dropped afterwards."""
        sc = self.config.scheduler_config
        num_tokens = min(sc.max_num_batched_tokens, sc.max_num_seqs * sc.max_model_len)
        num_seqs = max(1, min(sc.max_num_seqs, num_tokens))
        lens = np.full(num_seqs, num_tokens // num_seqs, dtype=np.int64)
        lens[: num_tokens % num_seqs] += 1
        lens = lens[lens > 0]
        self.initialize_kv_cache(1)
        try:
            input_ids, pos, md, ends = self._prefill_only_inputs(lens)
            intermediate = None
            if not self.model.shard.is_first:
                intermediate = self.make_empty_intermediate_tensors(num_tokens)
            with set_forward_context(md):
                hidden = self.model(input_ids, pos, intermediate)
            if self.model.shard.is_last:
                index = self._stage("logits_indices", ends - 1)
                logits = self.model.compute_logits(hidden.index_select(0, index))
                if logits is not None:
                    self.sampler.sample(logits, self._profile_sampling_metadata(len(lens)))
            if self.device.type == "cuda":
                torch.cuda.synchronize()
        finally:
            self.initialize_kv_cache(0)

    def _profile_sampling_metadata(self, num_rows: int) -> SamplingMetadata:
        """Random sampling with top-k and top-p on every row: the sampler's largest footprint."""
        f32 = torch.float32
        return SamplingMetadata(
            temperature=self._stage("temperature", np.ones(num_rows, np.float32), f32),
            greedy=self._stage("greedy", np.zeros(num_rows, np.bool_), torch.bool),
            all_greedy=False,
            top_k=self._stage("top_k", np.full(num_rows, self.vocab_size, np.int64)),
            top_k_max=self.vocab_size,  # the sort of the whole row: the largest footprint
            top_p=self._stage("top_p", np.full(num_rows, 0.9, np.float32), f32),
            min_p=None,
            generators=[None] * num_rows,
        )
