"""Sampler: logits -> one token per row, with logit bias, penalties, temperature, top-k, top-p,
min-p, per-request seeds and log-probabilities (of the model's own distribution: taken before any
of these change the logits).

Random rows use the exponential race (argmax of probs / q with q ~ Exp(1)), which draws from the
same distribution as multinomial sampling. A seeded request draws its noise from a generator seeded
by (seed, position), so its tokens do not depend on what else is in the batch, nor on preemption.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmctl.engine.core.model_runner_output import TokenLogprobs
from llmctl.engine.kernels.cpu import layer_ops

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, position) over the seed space


def position_seed(seed: int, position: int) -> int:
    return (seed * _MIX + position) & 0x7FFF_FFFF_FFFF_FFFF


def make_generator(device: torch.device, seed: int) -> torch.Generator | None:
    """A generator for random draws on `device`; None on the meta device (shape-only runs that
    check a step's device placement), which has no generator and draws nothing."""
    if device.type == "meta":
        return None
    return torch.Generator(device=device).manual_seed(seed)


@dataclass
class SamplingMetadata:
    """Every tensor is on the logits' device."""

    temperature: torch.Tensor | None  # [num_rows] float; None when all rows are greedy
    greedy: torch.Tensor | None  # [num_rows] bool; None when all rows are greedy
    all_greedy: bool
    top_k: torch.Tensor | None  # [num_rows] int64, vocab size where disabled
    top_p: torch.Tensor | None  # [num_rows] float
    min_p: torch.Tensor | None  # [num_rows] float
    seeds: list[int | None]  # per row: seed for this position, None: the shared generator
    # Penalties (None when no row uses them)
    presence_penalty: torch.Tensor | None = None  # [num_rows]
    frequency_penalty: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
    prompt_token_ids: torch.Tensor | None = None  # [num_rows, max_prompt] padded with vocab
    output_token_ids: torch.Tensor | None = None  # [num_rows, max_output] padded with vocab
    # Tokens a row may not sample yet (min_tokens), flattened: (rows, token ids), each
    # [num_forbidden]; None when no row has any.
    forbidden_tokens: tuple[torch.Tensor, torch.Tensor] | None = None
    # logit_bias of every row that has one, flattened: (rows, token ids, biases), each
    # [num_biased_tokens]; None when no row has a bias.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    num_logprobs: list[int | None] | None = None  # per row, None: no logprobs


class Sampler:
    def __init__(self, generator: torch.Generator | None) -> None:
        self.generator = generator  # for rows without a seed

    def __call__(
        self, logits: torch.Tensor, md: SamplingMetadata
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: float32 [num_rows, vocab_size] -> a token (and log-probabilities) per row."""
        sampled, stats = self.sample(logits, md)
        return self.to_host(sampled, stats, md.num_logprobs)

    def sample(
        self, logits: torch.Tensor, md: SamplingMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """On the device: the sampled ids [num_rows] and, when any row asked for them, the
        log-probability statistics packed for to_host. logits may be modified in place."""
        raw_logprobs = None
        if md.num_logprobs and any(k is not None for k in md.num_logprobs):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        if md.forbidden_tokens is not None:
            rows, token_ids = md.forbidden_tokens
            logits.index_put_((rows, token_ids), logits.new_tensor(float("-inf")))
        if md.logit_bias is not None:
            rows, token_ids, biases = md.logit_bias
            logits.index_put_((rows, token_ids), biases, accumulate=True)
        if md.presence_penalty is not None:
            logits = _apply_penalties(logits, md)
        greedy_tokens = _argmax(logits)
        if md.all_greedy:
            sampled = greedy_tokens
        else:
            sampled = torch.where(md.greedy, greedy_tokens, self._sample(logits, md))
        if raw_logprobs is None:
            return sampled, None
        return sampled, _logprob_stats(raw_logprobs, sampled, md.num_logprobs)

    @staticmethod
    def to_host(
        sampled: torch.Tensor, stats: torch.Tensor | None, num_logprobs: list[int | None] | None
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """The one device-to-host copy of a step: ids, or the packed statistics holding them."""
        if stats is None:
            tokens = sampled.cpu().tolist()
            return tokens, [None] * len(tokens)
        return _unpack_logprobs(stats.cpu(), num_logprobs)

    def _sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        temperature = torch.where(md.greedy, 1.0, md.temperature).unsqueeze(1)
        logits = logits / temperature
        if md.top_k is not None or md.top_p is not None:
            logits = _apply_top_k_top_p(logits, md.top_k, md.top_p)
        probs = torch.softmax(logits, dim=-1)
        if md.min_p is not None:
            threshold = md.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < threshold, 0.0)
        noise = torch.empty_like(probs)
        unseeded = [i for i, seed in enumerate(md.seeds) if seed is None]
        if unseeded:
            if len(unseeded) == len(md.seeds):
                noise.exponential_(generator=self.generator)
            else:
                index = torch.tensor(unseeded, device=probs.device)
                rows = probs.new_empty(len(unseeded), probs.shape[1])
                noise[index] = rows.exponential_(generator=self.generator)
        for row, seed in enumerate(md.seeds):
            if seed is not None:
                noise[row].exponential_(generator=make_generator(probs.device, seed))
        return (probs / noise).argmax(dim=-1)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1); on the CPU one vectorised C++ pass per row (kernels/cpu/
    layer_ops.py: torch's is a scalar loop, ~7 ms a step for 64 rows of a 49152-token vocab)."""
    ops = layer_ops.ops_for(logits)
    if ops is not None and logits.dtype == torch.float32 and logits.dim() == 2:
        return ops.argmax_rows(logits.contiguous())
    return logits.argmax(dim=-1)


def _apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    num_rows, vocab = logits.shape
    # column `vocab` is padding
    counts = torch.zeros(num_rows, vocab + 1, dtype=logits.dtype, device=logits.device)
    output_ids = md.output_token_ids
    counts.scatter_add_(1, output_ids, torch.ones_like(output_ids, dtype=logits.dtype))
    counts = counts[:, :vocab]
    seen = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=logits.device)
    seen.scatter_(1, md.prompt_token_ids, True)
    seen = seen[:, :vocab] | (counts > 0)
    rep = md.repetition_penalty.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - md.frequency_penalty.unsqueeze(1) * counts
    return logits - md.presence_penalty.unsqueeze(1) * (counts > 0).to(logits.dtype)


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask all but the k most likely tokens, then the tail beyond cumulative probability p."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab - top_k).clamp(min=0).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - top_p).unsqueeze(1)
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _logprob_stats(
    logprobs: torch.Tensor, sampled: torch.Tensor, num_logprobs: list[int | None]
) -> torch.Tensor:
    """[num_rows, 3 + 2k] float64: sampled id, its log-probability, its rank, then the top k
    ids and their log-probabilities (k: the most any row asked for). float64 holds every token
    id exactly, so one tensor carries everything to the host."""
    k_max = max(k for k in num_logprobs if k is not None)
    sampled_lp = logprobs.gather(1, sampled.unsqueeze(1))
    ranks = (logprobs > sampled_lp).sum(dim=-1, keepdim=True) + 1
    columns = [sampled.unsqueeze(1), sampled_lp, ranks]
    if k_max:
        top_lp, top_ids = logprobs.topk(k_max, dim=-1)
        columns += [top_ids, top_lp]
    return torch.cat([c.to(torch.float64) for c in columns], dim=1)


def _unpack_logprobs(
    stats: torch.Tensor, num_logprobs: list[int | None]
) -> tuple[list[int], list[TokenLogprobs | None]]:
    rows = stats.tolist()
    k_max = (stats.shape[1] - 3) // 2
    tokens, out = [], []
    for row, k in zip(rows, num_logprobs, strict=True):
        tokens.append(int(row[0]))
        if k is None:
            out.append(None)
            continue
        out.append(
            TokenLogprobs(
                sampled_logprob=row[1],
                sampled_rank=int(row[2]),
                top_token_ids=[int(t) for t in row[3 : 3 + k]],
                top_logprobs=row[3 + k_max : 3 + k_max + k],
            )
        )
    return tokens, out
