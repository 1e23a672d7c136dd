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

from llmctl.engine.model_runner_output import TokenLogprobs

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, position) over the seed space


def position_seed(seed: int, position: int) -> int:
    return (seed * _MIX + position) & 0x7FFF_FFFF_FFFF_FFFF


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [num_rows] float; 0 for greedy rows
    greedy: torch.Tensor  # [num_rows] bool
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
    # Rows that must not stop yet (min_tokens): (row, token ids to forbid)
    forbidden_tokens: list[tuple[int, list[int]]] | None = None
    # logit_bias of every row that has one, flattened: (rows, token ids, biases), each
    # [num_biased_tokens]; None when no row has a bias.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    num_logprobs: list[int | None] | None = None  # per row, None: no logprobs


class Sampler:
    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator  # for rows without a seed

    def __call__(
        self, logits: torch.Tensor, md: SamplingMetadata
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: float32 [num_rows, vocab_size]."""
        raw_logprobs = None
        if md.num_logprobs and any(k is not None for k in md.num_logprobs):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        if md.forbidden_tokens:
            for row, tokens in md.forbidden_tokens:
                logits[row, tokens] = float("-inf")
        if md.logit_bias is not None:
            rows, token_ids, biases = md.logit_bias
            logits.index_put_((rows, token_ids), biases, accumulate=True)
        if md.presence_penalty is not None:
            logits = _apply_penalties(logits, md)
        greedy_tokens = logits.argmax(dim=-1)
        if md.all_greedy:
            sampled = greedy_tokens
        else:
            sampled = torch.where(md.greedy, greedy_tokens, self._sample(logits, md))
        tokens = sampled.tolist()
        if raw_logprobs is None:
            return tokens, [None] * len(tokens)
        return tokens, _gather_logprobs(raw_logprobs, sampled, md.num_logprobs)

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
                rows = torch.empty(len(unseeded), probs.shape[1])
                noise[unseeded] = rows.exponential_(generator=self.generator)
        for row, seed in enumerate(md.seeds):
            if seed is not None:
                generator = torch.Generator(device=probs.device).manual_seed(seed)
                noise[row].exponential_(generator=generator)
        return (probs / noise).argmax(dim=-1)


def _apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    num_rows, vocab = logits.shape
    counts = torch.zeros(num_rows, vocab + 1, dtype=logits.dtype)  # column `vocab` is padding
    output_ids = md.output_token_ids
    counts.scatter_add_(1, output_ids, torch.ones_like(output_ids, dtype=logits.dtype))
    counts = counts[:, :vocab]
    seen = torch.zeros(num_rows, vocab + 1, dtype=torch.bool)
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


def _gather_logprobs(
    logprobs: torch.Tensor, sampled: torch.Tensor, num_logprobs: list[int | None]
) -> list[TokenLogprobs | None]:
    k_max = max(k for k in num_logprobs if k is not None)
    sampled_lp = logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1)
    ranks = (logprobs > sampled_lp.unsqueeze(1)).sum(dim=-1) + 1
    top_lp, top_ids = logprobs.topk(k_max, dim=-1) if k_max else (None, None)
    out: list[TokenLogprobs | None] = []
    for row, k in enumerate(num_logprobs):
        if k is None:
            out.append(None)
            continue
        out.append(
            TokenLogprobs(
                sampled_logprob=float(sampled_lp[row]),
                sampled_rank=int(ranks[row]),
                top_token_ids=top_ids[row, :k].tolist() if k else [],
                top_logprobs=top_lp[row, :k].tolist() if k else [],
            )
        )
    return out
