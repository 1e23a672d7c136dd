"""SamplingState: the model runner's per-request sampling state, and a step's SamplingMetadata.

Each seeded request has its own generator, made once when the request arrives and kept until
it finishes (a preempted request's goes on where it was); requests with penalties have their
token counts on the device (worker/penalty_counts.py). A step's SamplingMetadata is read from the
input batch's sampling columns with vectorised gathers: Python touches only the rows that need
something special (min_tokens still holding off a stop token, a logit_bias, logprobs).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from llmctl.engine.sampling_params import SamplingParams
from llmctl.engine.worker.input_batch import InputBatch
from llmctl.engine.worker.penalty_counts import PenaltyCounts
from llmctl.engine.worker.sampler import SamplingMetadata, make_generator

Stage = Callable[..., torch.Tensor]  # ModelRunner._stage: (name, values[, dtype]) -> device


class SamplingState:
    def __init__(self, batch: InputBatch, device: torch.device, vocab_size: int, stage: Stage):
        self.batch = batch
        self.device = device
        self.vocab_size = vocab_size
        self.stage = stage
        self.generators: dict[str, torch.Generator] = {}
        self.penalties = PenaltyCounts(vocab_size, device)

    def add_request(self, req_id: str, params: SamplingParams) -> None:
        """A new request, or a preempted one back (its generator is kept)."""
        if params.seed is not None and req_id not in self.generators:
            generator = make_generator(self.device, params.seed)
            if generator is not None:
                self.generators[req_id] = generator

    def remove_request(self, req_id: str) -> None:
        self.generators.pop(req_id, None)
        self.penalties.remove(req_id)

    def metadata(self, rows: np.ndarray) -> SamplingMetadata:
        """The step's SamplingMetadata for these input-batch rows, in this order."""
        batch, stage, f32 = self.batch, self.stage, torch.float32
        greedy = batch.greedy[rows]
        all_greedy = bool(greedy.all())
        generators: list = [None] * len(rows)
        if self.generators:
            generators = [self.generators.get(batch.req_ids[r]) for r in rows.tolist()]
        md = SamplingMetadata(
            temperature=None,
            greedy=None,
            all_greedy=all_greedy,
            top_k=None,
            top_p=None,
            min_p=None,
            generators=generators,
        )
        if not all_greedy:
            md.temperature = stage("temperature", batch.temperature[rows], f32)
            md.greedy = stage("greedy", greedy, torch.bool)
            top_k = batch.top_k[rows]
            if (top_k < self.vocab_size).any():
                md.top_k = stage("top_k", top_k)
                md.top_k_max = int(top_k.max())
            if (batch.top_p[rows] < 1.0).any():
                md.top_p = stage("top_p", batch.top_p[rows], f32)
            if (batch.min_p[rows] > 0).any():
                md.min_p = stage("min_p", batch.min_p[rows], f32)
        self._forbidden(md, rows)
        self._logit_bias(md, rows)
        self._penalties(md, rows)
        logprobs = batch.logprobs[rows]
        if (logprobs >= 0).any():
            md.num_logprobs = [None if k < 0 else k for k in logprobs.tolist()]
        return md

    def record(self, md: SamplingMetadata, sampled: torch.Tensor) -> None:
        """After sampling: the penalised rows' tokens counted, on the device."""
        if md.penalty_slots is not None:
            self.penalties.record(md.penalty_slots, sampled)

    def _forbidden(self, md: SamplingMetadata, rows: np.ndarray) -> None:
        """Before min_tokens, the tokens that would stop a request cannot be sampled."""
        batch = self.batch
        generated = batch.num_tokens[rows] - batch.num_prompt_tokens[rows]
        holding = np.flatnonzero(batch.has_stop_ids[rows] & (generated < batch.min_tokens[rows]))
        if not len(holding):
            return
        pairs = np.array(
            [
                (i, token)
                for i in holding.tolist()
                for token in sorted(batch.sampling_params[rows[i]].all_stop_token_ids)
            ],
            dtype=np.int64,
        )
        md.forbidden_tokens = (
            self.stage("forbidden_rows", pairs[:, 0]),
            self.stage("forbidden_ids", pairs[:, 1]),
        )

    def _logit_bias(self, md: SamplingMetadata, rows: np.ndarray) -> None:
        batch = self.batch
        biased = np.flatnonzero(batch.has_logit_bias[rows])
        if not len(biased):
            return
        entries = [
            (i, token, bias)
            for i in biased.tolist()
            for token, bias in batch.sampling_params[rows[i]].logit_bias.items()
        ]
        md.logit_bias = (
            self.stage("bias_rows", np.array([e[0] for e in entries], np.int64)),
            self.stage("bias_ids", np.array([e[1] for e in entries], np.int64)),
            self.stage("bias_values", np.array([e[2] for e in entries], np.float32), torch.float32),
        )

    def _penalties(self, md: SamplingMetadata, rows: np.ndarray) -> None:
        batch, f32 = self.batch, torch.float32
        penalised = np.flatnonzero(batch.has_penalties[rows])
        if not len(penalised):
            return
        md.presence_penalty = self.stage("presence", batch.presence[rows], f32)
        md.frequency_penalty = self.stage("frequency", batch.frequency[rows], f32)
        md.repetition_penalty = self.stage("repetition", batch.repetition[rows], f32)
        requests = []
        for i in penalised.tolist():
            row = rows[i]
            tokens = batch.token_ids[row, : batch.num_tokens[row]]
            prompt = batch.num_prompt_tokens[row]
            requests.append((batch.req_ids[row], tokens[:prompt], tokens[prompt:]))
        slots = np.zeros(len(rows), np.int64)
        slots[penalised] = self.penalties.slots(requests, self.stage)
        md.penalty_slots = self.stage("penalty_row_slots", slots)
        md.prompt_seen, md.output_counts = self.penalties.rows(md.penalty_slots)
