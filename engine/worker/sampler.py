"""Sampler: logits -> one token per row, with logit bias, penalties, temperature, top-k, top-p,
min-p, per-request seeds and log-probabilities (of the model's own distribution: taken before any
of these change the logits).

Random rows use the exponential race (argmax of probs / q with q ~ Exp(1)), which draws from the
same distribution as multinomial sampling. A seeded request draws its noise from its own generator
(worker/sampling_state.py keeps one per request, seeded once), so its tokens do not depend on
what else is in the batch, nor on preemption (its generator goes on where it was). Top-k keeps the
k most likely tokens found by a top-k selection, not a sort of the vocabulary; top-p then sorts
only those k (a sort of the whole row only for top-p without top-k). Penalties read per-request
token counts kept on the device (worker/penalty_counts.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmctl.engine.core.model_runner_output import TokenLogprobs
from llmctl.engine.kernels.cpu import layer_ops


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
    generators: list[torch.Generator | None]  # per row: its request's, None: the shared one
    top_k_max: int = 0  # the largest top_k of the rows (host value; vocab size: some row has none)
    # Penalties (None when no row uses them)
    presence_penalty: torch.Tensor | None = None  # [num_rows]
    frequency_penalty: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
    prompt_seen: torch.Tensor | None = None  # [num_rows, vocab] bool: in the row's prompt
    output_counts: torch.Tensor | None = None  # [num_rows, vocab] float: times generated
    penalty_slots: torch.Tensor | None = None  # [num_rows] int64: PenaltyCounts slots, 0 none
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
        """logits: float [num_rows, vocab_size] -> a token (and log-probabilities) per row."""
        sampled, stats = self.sample(logits, md)
        return self.to_host(sampled, stats, md.num_logprobs)

    def sample(
        self, logits: torch.Tensor, md: SamplingMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """On the device: the sampled ids [num_rows] and, when any row asked for them, the
        log-probability statistics packed for to_host. logits (float32, or the model's
        bfloat16) may be modified in place; everything but a plain greedy argmax runs on them
        in float32."""
        wants_logprobs = bool(md.num_logprobs) and any(k is not None for k in md.num_logprobs)
        if md.all_greedy and not (
            wants_logprobs
            or md.forbidden_tokens is not None
            or md.logit_bias is not None
            or md.presence_penalty is not None
        ):
            return _argmax(logits), None  # the values' argmax: no float32 copy needed
        logits = logits.float()
        raw_logprobs = None
        if wants_logprobs:
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
            logits = _apply_top_k_top_p(logits, md.top_k, md.top_p, md.top_k_max)
        probs = torch.softmax(logits, dim=-1)
        if md.min_p is not None:
            threshold = md.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < threshold, 0.0)
        noise = torch.empty_like(probs)
        seeded = [i for i, g in enumerate(md.generators) if g is not None]
        if len(seeded) < len(md.generators):
            noise.exponential_(generator=self.generator)  # (seeded rows are drawn again below)
        for row in seeded:
            noise[row].exponential_(generator=md.generators[row])
        return (probs / noise).argmax(dim=-1)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1); on the CPU one vectorised C++ pass per row, float32 or bfloat16
    (kernels/cpu/layer_ops.py: torch's is a scalar loop, ~7 ms a step for 64 rows of a
    49152-token vocab)."""
    if logits.is_cpu and logits.dtype not in (torch.float32, torch.bfloat16):
        logits = logits.float()  # float16: torch's CPU argmax is the scalar loop
    ops = layer_ops.ops_for(logits)
    if ops is not None and logits.dim() == 2:
        return ops.argmax_rows(logits.contiguous())
    return logits.argmax(dim=-1)


def _apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    counts = md.output_counts.to(logits.dtype)
    seen = md.prompt_seen | (counts > 0)
    rep = md.repetition_penalty.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - md.frequency_penalty.unsqueeze(1) * counts
    return logits - md.presence_penalty.unsqueeze(1) * (counts > 0).to(logits.dtype)


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, k_max: int
) -> torch.Tensor:
    """Mask all but the k most likely tokens, then the tail beyond cumulative probability p."""
    vocab = logits.shape[-1]
    if top_k is not None and 0 < k_max < vocab:
        return _top_k_then_p(logits, top_k, top_p, k_max)
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


def _top_k_then_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor | None, k_max: int
) -> torch.Tensor:
    """Top-k (every row has a k <= k_max) from a top-k selection of k_max candidates; top-p over
    those candidates alone. Both become a threshold: logits below it are masked (ties at the
    threshold kept, as the sort-based path keeps them)."""
    values = logits.topk(k_max, dim=-1).values  # [num_rows, k_max], descending
    ranks = torch.arange(k_max, device=logits.device)
    in_k = ranks.unsqueeze(0) < top_k.unsqueeze(1)  # [num_rows, k_max]
    threshold = values.gather(1, (top_k.clamp(max=k_max) - 1).unsqueeze(1))
    if top_p is not None:
        candidates = values.masked_fill(~in_k, float("-inf"))
        probs = candidates.softmax(dim=-1)
        # a candidate stays while the mass more likely than it is below p (the first always)
        above = probs.cumsum(dim=-1) - probs
        kept = (above < top_p.unsqueeze(1)) & in_k
        last = (kept.sum(dim=-1, keepdim=True) - 1).clamp(min=0)
        threshold = torch.maximum(threshold, values.gather(1, last))
    return logits.masked_fill(logits < threshold, float("-inf"))


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
