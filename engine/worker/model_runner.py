"""ModelRunner: turns a SchedulerOutput into model inputs on the device, runs the model, samples.

Requests arrive whole once (NewRequestData) and then as diffs (CachedRequestData); the runner keeps
them in an InputBatch (persistent host rows: tokens, block table, sampling settings), updated in
place. A step's inputs are gathered from those rows with vectorised numpy into StagedBuffers and
copied to the device once each (pinned host memory on CUDA): input ids, positions, slot mapping,
decode and prefill block tables and lengths, logits indices, sampling tensors. Tokens of a step
are laid out decodes first, then prefill chunks, as the attention layer expects. The sampled ids
(and log-probabilities, when asked) come back to the host in one copy.

On CUDA, decode-only steps replay CUDA graphs captured at padded batch sizes (CudaGraphRunner)
unless enforce_eager is set.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llmctl.engine.attention.layer import Attention
from llmctl.engine.attention.metadata import AttentionMetadata, PrefillChunk
from llmctl.engine.attention.selector import get_attn_backend
from llmctl.engine.config.engine_config import EngineConfig
from llmctl.engine.core.model_runner_output import ModelRunnerOutput
from llmctl.engine.core.scheduler_output import SchedulerOutput
from llmctl.engine.forward_context import set_forward_context
from llmctl.engine.models.utils import IntermediateTensors
from llmctl.engine.platform import torch_dtype
from llmctl.engine.worker.input_batch import InputBatch, StagedBuffer
from llmctl.engine.worker.sampler import Sampler, SamplingMetadata, make_generator, position_seed


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
        self.sliding_window: int | None = getattr(model, "sliding_window", None)
        if self.sliding_window and self.sliding_window >= mc.max_model_len:
            self.sliding_window = None  # the window never bites
        self.input_batch = InputBatch(sc.max_num_seqs, mc.max_model_len, self.block_size)
        self._buffers: dict[str, StagedBuffer] = {}
        self._copies_done = None  # CUDA: event after the last step's host-to-device copies
        self.sampler = Sampler(make_generator(self.device, mc.seed))
        self.attn_backend = get_attn_backend(self.device)  # once: the layers never choose
        self.fused_decode = _fused_decode(model, self.attn_backend)
        self.kv_caches: list[torch.Tensor] = []
        self.cuda_graphs = None  # CudaGraphRunner, once the KV cache exists (CUDA only)
        self._scratch_kv: list[torch.Tensor] | None = None  # execute_dummy_batch's KV block

    # -- KV cache ------------------------------------------------------------------------------

    def attention_layers(self) -> list[Attention]:
        return [m for m in self.model.modules() if isinstance(m, Attention)]

    def kv_cache_bytes_per_block(self) -> int:
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        return sum(
            2 * self.block_size * layer.num_kv_heads * layer.head_dim * itemsize
            for layer in self.attention_layers()
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
        self.kv_caches = []
        for layer in self.attention_layers():
            shape = (2, num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
            cache = zeroed_kv_cache(shape, self.dtype, self.device)
            layer.bind(cache, self.attn_backend)
            self.kv_caches.append(cache)

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
        md = self._sampling_metadata(inputs.sampled_rows)
        self._end_staging()  # again: the sampling tensors' copies read host buffers too
        sampled, stats = self.sampler.sample(logits, md)
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
        for new in so.scheduled_new_reqs:
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
        slots = batch.block_table[token_req, positions // bs] * bs + positions % bs
        sampled = np.flatnonzero(seq_lens >= batch.num_tokens[rows])
        batch.num_computed_tokens[rows] = seq_lens

        self._begin_staging()
        graphs = self.cuda_graphs
        pad_to = graphs.padded_size(num_decodes, total) if graphs is not None else None
        md = AttentionMetadata(
            slot_mapping=self._stage_padded("slot_mapping", slots, pad_to, -1),
            num_decodes=num_decodes,
            sliding_window=self.sliding_window,
        )
        if num_decodes:
            d_rows, d_lens = rows[:num_decodes], seq_lens[:num_decodes]
            width = graphs.table_width if pad_to else int(-(-d_lens.max() // bs))
            tables = batch.block_table[d_rows, :width]
            md.decode_block_tables = self._stage_padded("decode_block_tables", tables, pad_to, 0)
            md.decode_seq_lens = self._stage_padded("decode_seq_lens", d_lens, pad_to, 0)
        if num_decodes < len(rows):
            self._prefill_metadata(md, rows, num_new, seq_lens, computed, num_decodes)
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

    def _prefill_metadata(self, md, rows, num_new, seq_lens, computed, num_decodes) -> None:
        bs = self.block_size
        p_rows, p_new = rows[num_decodes:], num_new[num_decodes:]
        p_lens, p_ctx = seq_lens[num_decodes:], computed[num_decodes:]
        starts = np.concatenate(([0], np.cumsum(p_new)))
        width = int(-(-p_lens.max() // bs))
        md.prefill_block_tables = self._stage(
            "prefill_block_tables", self.input_batch.block_table[p_rows, :width]
        ).view(len(p_rows), width)
        md.prefill_query_start_loc = self._stage("prefill_query_start_loc", starts)
        md.prefill_seq_lens = self._stage("prefill_seq_lens", p_lens)
        md.prefill_context_lens = self._stage("prefill_context_lens", p_ctx)
        md.max_prefill_query_len = int(p_new.max())
        md.prefills = [
            PrefillChunk(num_decodes + int(s), int(n), int(length), int(ctx), i)
            for i, (s, n, length, ctx) in enumerate(
                zip(starts[:-1], p_new, p_lens, p_ctx, strict=True)
            )
        ]

    def _sampling_metadata(self, rows: np.ndarray) -> SamplingMetadata:
        batch = self.input_batch
        params = [batch.sampling_params[r] for r in rows.tolist()]
        num_tokens = batch.num_tokens[rows]
        greedy = batch.greedy[rows]
        all_greedy = bool(greedy.all())
        f32 = torch.float32
        md = SamplingMetadata(
            temperature=None,
            greedy=None,
            all_greedy=all_greedy,
            top_k=None,
            top_p=None,
            min_p=None,
            seeds=[
                None if p.seed is None else position_seed(p.seed, int(n))
                for p, n in zip(params, num_tokens, strict=True)
            ],
        )
        if not all_greedy:
            md.temperature = self._stage("temperature", batch.temperature[rows], f32)
            md.greedy = self._stage("greedy", greedy, torch.bool)
            if any(p.top_k for p in params):
                md.top_k = self._stage("top_k", batch.top_k[rows])
            if any(p.top_p < 1.0 for p in params):
                md.top_p = self._stage("top_p", batch.top_p[rows], f32)
            if any(p.min_p > 0 for p in params):
                md.min_p = self._stage("min_p", batch.min_p[rows], f32)
        # Before min_tokens, the tokens that would stop the request cannot be sampled.
        forbidden = [
            (i, token)
            for i, p in enumerate(params)
            if p.all_stop_token_ids
            and num_tokens[i] - batch.num_prompt_tokens[rows[i]] < p.min_tokens
            for token in sorted(p.all_stop_token_ids)
        ]
        if forbidden:
            pairs = np.array(forbidden, dtype=np.int64)
            md.forbidden_tokens = (
                self._stage("forbidden_rows", pairs[:, 0]),
                self._stage("forbidden_ids", pairs[:, 1]),
            )
        if any(p.logit_bias for p in params):
            biased = [
                (i, t, b) for i, p in enumerate(params) for t, b in (p.logit_bias or {}).items()
            ]
            md.logit_bias = (
                self._stage("bias_rows", np.array([x[0] for x in biased], np.int64)),
                self._stage("bias_ids", np.array([x[1] for x in biased], np.int64)),
                self._stage("bias_values", np.array([x[2] for x in biased], np.float32), f32),
            )
        if any(p.uses_penalties for p in params):
            md.presence_penalty = self._stage("presence", batch.presence[rows], f32)
            md.frequency_penalty = self._stage("frequency", batch.frequency[rows], f32)
            md.repetition_penalty = self._stage("repetition", batch.repetition[rows], f32)
            md.prompt_token_ids, md.output_token_ids = self._penalty_token_ids(rows)
        if any(p.logprobs is not None for p in params):
            md.num_logprobs = [p.logprobs for p in params]
        return md

    def _penalty_token_ids(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_rows, width] prompt and output token ids, padded with vocab_size."""
        batch = self.input_batch
        num_tokens = batch.num_tokens[rows][:, None]
        num_prompt = batch.num_prompt_tokens[rows][:, None]
        width = int(num_tokens.max())
        tokens = batch.token_ids[rows, :width].astype(np.int64)
        col = np.arange(width)[None, :]
        prompt = np.where(col < num_prompt, tokens, self.vocab_size)
        output = np.where((col >= num_prompt) & (col < num_tokens), tokens, self.vocab_size)
        shape = (len(rows), width)
        return (
            self._stage("prompt_token_ids", prompt).view(shape),
            self._stage("output_token_ids", output).view(shape),
        )

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
                zeroed_kv_cache(
                    (2, 1, self.block_size, layer.num_kv_heads, layer.head_dim),
                    self.dtype,
                    self.device,
                )
                for layer in layers
            ]
        bound = [layer.kv_cache for layer in layers]
        self._begin_staging()
        input_ids, positions, md, _ = self._prefill_only_inputs(np.ones(1, np.int64))
        self._end_staging()
        for layer, scratch in zip(layers, self._scratch_kv, strict=True):
            layer.bind(scratch, self.attn_backend)
        try:
            with set_forward_context(md):
                self.model(input_ids, positions, None)
        finally:
            for layer, cache in zip(layers, bound, strict=True):
                layer.bind(cache, self.attn_backend)

    def _prefill_only_inputs(self, lens: np.ndarray):
        """(input_ids, positions, AttentionMetadata, ends) of prefills of `lens` tokens with no
        context, token id 0, every key and value written to slot 0."""
        num_tokens = int(lens.sum())
        ends = np.cumsum(lens)
        starts = ends - lens
        positions = np.arange(num_tokens) - np.repeat(starts, lens)
        md = AttentionMetadata(
            slot_mapping=self._stage("slot_mapping", np.zeros(num_tokens, np.int64)),
            num_decodes=0,
            sliding_window=self.sliding_window,
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
            top_p=self._stage("top_p", np.full(num_rows, 0.9, np.float32), f32),
            min_p=None,
            seeds=[None] * num_rows,
        )
