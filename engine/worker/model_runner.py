"""ModelRunner: keeps each request's tokens and block table, turns a SchedulerOutput into model
inputs (token ids, positions, slot mapping, attention metadata), runs the model and samples.

Requests arrive whole once (NewRequestData) and then as diffs (CachedRequestData); the runner's
CachedRequestState is the worker-side copy. Tokens of a step are laid out decodes first, then
prefill chunks, as the attention layer expects.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llmctl.engine.config import EngineConfig
from llmctl.engine.forward_context import set_forward_context
from llmctl.engine.layers.attention import Attention, AttentionMetadata, PrefillChunk
from llmctl.engine.layers.sampler import Sampler, SamplingMetadata, position_seed
from llmctl.engine.model_runner_output import ModelRunnerOutput
from llmctl.engine.models.utils import IntermediateTensors
from llmctl.engine.platform import torch_dtype
from llmctl.engine.sampling_params import SamplingParams
from llmctl.engine.scheduler_output import SchedulerOutput


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampled]: rows whose next token is sampled
    sampled_states: list[CachedRequestState]


class ModelRunner:
    def __init__(self, engine_config: EngineConfig, model: torch.nn.Module):
        self.config = engine_config
        self.model = model
        self.block_size = engine_config.cache_config.block_size
        self.dtype = torch_dtype(engine_config.model_config.dtype)
        self.device = torch.device(engine_config.device_config.device)
        self.sliding_window: int | None = getattr(model, "sliding_window", None)
        if self.sliding_window and self.sliding_window >= engine_config.model_config.max_model_len:
            self.sliding_window = None  # the window never bites
        self.requests: dict[str, CachedRequestState] = {}
        generator = torch.Generator(device=self.device)
        generator.manual_seed(engine_config.model_config.seed)
        self.sampler = Sampler(generator)
        self.kv_caches: list[torch.Tensor] = []

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
            cache = torch.zeros(
                2,
                num_blocks,
                self.block_size,
                layer.num_kv_heads,
                layer.head_dim,
                dtype=self.dtype,
                device=self.device,
            )
            layer.kv_cache = cache
            self.kv_caches.append(cache)

    # -- one step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(
        self,
        scheduler_output: SchedulerOutput,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> ModelRunnerOutput | IntermediateTensors | None:
        """Run one step. Returns the sampled tokens (last pipeline stage, tp_rank 0), the
        hidden states for the next stage (other stages), or None (other tensor-parallel ranks)."""
        self._update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput()
        inputs = self._prepare_inputs(scheduler_output)
        with set_forward_context(inputs.attn_metadata):
            hidden = self.model(inputs.input_ids, inputs.positions, intermediate_tensors)
        if not self.model.shard.is_last:
            return hidden
        output = ModelRunnerOutput()
        if not inputs.sampled_states:
            return output
        logits = self.model.compute_logits(hidden.index_select(0, inputs.logits_indices))
        if logits is None:
            return None  # another tensor-parallel rank samples
        tokens, logprobs = self.sampler(logits, self._sampling_metadata(inputs.sampled_states))
        for state, token, lp in zip(inputs.sampled_states, tokens, logprobs, strict=True):
            output.sampled_token_ids[state.req_id] = token
            if lp is not None:
                output.logprobs[state.req_id] = lp
        return output

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                sampling_params=new.sampling_params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
            )
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.token_ids.extend(cached.new_token_ids)
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _prepare_inputs(self, so: SchedulerOutput) -> ModelInputs:
        bs = self.block_size
        scheduled = [(self.requests[r], n) for r, n in so.num_scheduled_tokens.items()]
        # Decodes (one token) first, then prefill chunks.
        decodes = [(s, n) for s, n in scheduled if n == 1]
        prefills = [(s, n) for s, n in scheduled if n > 1]
        ordered = decodes + prefills

        token_chunks, position_chunks, slot_chunks = [], [], []
        logits_indices: list[int] = []
        sampled_states: list[CachedRequestState] = []
        chunks: list[PrefillChunk] = []
        offset = 0
        for state, n in ordered:
            start = state.num_computed_tokens
            positions = np.arange(start, start + n, dtype=np.int64)
            table = np.asarray(state.block_ids, dtype=np.int64)
            slot_chunks.append(table[positions // bs] * bs + positions % bs)
            position_chunks.append(positions)
            token_chunks.append(state.token_ids[start : start + n])
            if n > 1:
                chunks.append(self._prefill_chunk(state, offset, start, n))
            if start + n >= len(state.token_ids):
                logits_indices.append(offset + n - 1)
                sampled_states.append(state)
            state.num_computed_tokens = start + n
            offset += n

        attn_metadata = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slot_chunks)),
            num_decodes=len(decodes),
            prefills=chunks,
        )
        if decodes:
            self._decode_metadata(attn_metadata, [s for s, _ in decodes])
        input_ids = torch.tensor([t for chunk in token_chunks for t in chunk], dtype=torch.int64)
        return ModelInputs(
            input_ids=input_ids.to(self.device),
            positions=torch.from_numpy(np.concatenate(position_chunks)).to(self.device),
            attn_metadata=attn_metadata,
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=self.device),
            sampled_states=sampled_states,
        )

    def _prefill_chunk(
        self, state: CachedRequestState, offset: int, start: int, n: int
    ) -> PrefillChunk:
        seq_len = start + n
        window = self.sliding_window
        if start == 0 and (window is None or seq_len <= window):
            return PrefillChunk(offset, n, seq_len, None, None)  # plain causal over its own keys
        q_pos = torch.arange(start, seq_len).unsqueeze(1)
        k_pos = torch.arange(seq_len).unsqueeze(0)
        mask = k_pos <= q_pos
        if window is not None:
            mask &= k_pos > q_pos - window
        block_ids = None
        if start > 0:
            num_blocks = -(-seq_len // self.block_size)
            block_ids = torch.tensor(state.block_ids[:num_blocks], dtype=torch.int64)
        return PrefillChunk(offset, n, seq_len, block_ids, mask)

    def _decode_metadata(self, md: AttentionMetadata, states: list[CachedRequestState]) -> None:
        bs = self.block_size
        seq_lens = np.array([s.num_computed_tokens for s in states], dtype=np.int64)
        num_blocks = -(-seq_lens // bs)
        table = np.zeros((len(states), int(num_blocks.max())), dtype=np.int64)
        for row, state in enumerate(states):
            table[row, : num_blocks[row]] = state.block_ids[: num_blocks[row]]
        md.decode_block_tables = torch.from_numpy(table).to(self.device)
        md.decode_seq_lens = torch.from_numpy(seq_lens).to(self.device)
        md.sliding_window = self.sliding_window

    def _sampling_metadata(self, states: list[CachedRequestState]) -> SamplingMetadata:
        params = [s.sampling_params for s in states]
        greedy = [p.greedy for p in params]
        vocab = self.model.config.vocab_size
        all_greedy = all(greedy)
        top_k = top_p = min_p = None
        if not all_greedy:
            if any(p.top_k for p in params):
                top_k = torch.tensor([p.top_k or vocab for p in params], dtype=torch.int64)
            if any(p.top_p < 1.0 for p in params):
                top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
            if any(p.min_p > 0 for p in params):
                min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)
        md = SamplingMetadata(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32),
            greedy=torch.tensor(greedy, dtype=torch.bool),
            all_greedy=all_greedy,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            seeds=[
                None if p.seed is None else position_seed(p.seed, len(s.token_ids))
                for s, p in zip(states, params, strict=True)
            ],
        )
        # Before min_tokens, the tokens that would stop the request cannot be sampled.
        forbidden = [
            (row, sorted(s.sampling_params.all_stop_token_ids))
            for row, s in enumerate(states)
            if s.sampling_params.all_stop_token_ids
            and len(s.token_ids) - s.num_prompt_tokens < s.sampling_params.min_tokens
        ]
        md.forbidden_tokens = forbidden or None
        if any(p.logit_bias for p in params):
            md.logit_bias = self._logit_bias(params)
        if any(p.uses_penalties for p in params):
            md.presence_penalty = torch.tensor([p.presence_penalty for p in params])
            md.frequency_penalty = torch.tensor([p.frequency_penalty for p in params])
            md.repetition_penalty = torch.tensor([p.repetition_penalty for p in params])
            md.prompt_token_ids = _pad([s.token_ids[: s.num_prompt_tokens] for s in states], vocab)
            md.output_token_ids = _pad([s.token_ids[s.num_prompt_tokens :] for s in states], vocab)
        if any(p.logprobs is not None for p in params):
            md.num_logprobs = [p.logprobs for p in params]
        return md

    def _logit_bias(
        self, params: list[SamplingParams]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows, token_ids, biases = [], [], []
        for row, p in enumerate(params):
            for token_id, bias in (p.logit_bias or {}).items():
                rows.append(row)
                token_ids.append(token_id)
                biases.append(bias)
        return (
            torch.tensor(rows, dtype=torch.int64, device=self.device),
            torch.tensor(token_ids, dtype=torch.int64, device=self.device),
            torch.tensor(biases, dtype=torch.float32, device=self.device),
        )


def _pad(rows: list[list[int]], pad: int) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0) or 1
    out = torch.full((len(rows), width), pad, dtype=torch.int64)
    for i, row in enumerate(rows):
        if row:
            out[i, : len(row)] = torch.tensor(row, dtype=torch.int64)
    return out
