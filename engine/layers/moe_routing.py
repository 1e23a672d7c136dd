"""Routing: how a mixture of experts' router logits choose each token's experts and weights.

    Routing(top_k, renormalize).select(router_logits)             # Mixtral, Qwen MoE
    Routing(top_k, renormalize, scoring_func="sigmoid", num_expert_group=8, topk_group=4,
            routed_scaling_factor=2.5).select(router_logits, e_score_correction_bias)  # V3

-> (weights [num_tokens, top_k] float32, expert ids [num_tokens, top_k]), as transformers' routers
compute them (the arguments are vLLM's FusedMoE's):
- softmax scoring (Mixtral, Qwen MoE, DeepSeek-V2): probabilities over the experts, the top-k,
  divided by their sum when `renormalize`;
- grouped selection (DeepSeek-V2's group_limited_greedy: a group's score is its best expert's
  probability, the experts of the other groups scored 0): only the experts of the topk_group best
  of num_expert_group groups compete;
- sigmoid scoring with a correction bias (DeepSeek-V3, Kimi-K2, GLM-4.5's noaux_tc): each expert's
  sigmoid plus its learned bias chooses (a group's score: the sum of its two best), the sigmoid
  alone weighs, divided by the chosen weights' sum (+1e-20) when `renormalize`;
then every weight times routed_scaling_factor. Scores are computed in float32 from float32 logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmctl.engine.errors import ConfigError

SCORING_FUNCS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class Routing:
    top_k: int
    renormalize: bool
    scoring_func: str = "softmax"
    num_expert_group: int | None = None  # experts are chosen within the best topk_group groups
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.scoring_func not in SCORING_FUNCS:
            raise ConfigError(
                f"unknown MoE scoring function {self.scoring_func!r}",
                f"llmctl routes with {' or '.join(SCORING_FUNCS)} scores",
            )

    @property
    def grouped(self) -> bool:
        return bool(self.num_expert_group) and self.num_expert_group > 1

    def check(self, num_experts: int, what: str) -> None:
        """ConfigError when the groups do not divide the experts or choose too few of them."""
        if not self.grouped:
            return
        groups, chosen = self.num_expert_group, self.topk_group or 0
        if num_experts % groups or not 1 <= chosen <= groups:
            raise ConfigError(
                f"{what}: {num_experts} experts in n_group={groups} groups, topk_group={chosen}",
                "n_group must divide the routed experts and topk_group be 1 .. n_group; "
                "fix the model's config.json",
            )
        if self.top_k > chosen * (num_experts // groups):
            raise ConfigError(
                f"{what}: top-{self.top_k} experts from {chosen} groups of {num_experts // groups}",
                "fix num_experts_per_tok or topk_group in the model's config.json",
            )

    def select(
        self, router_logits: torch.Tensor, bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """router_logits [num_tokens, num_experts] -> (weights float32, ids), [num_tokens, k]."""
        logits = router_logits.float()
        if self.scoring_func == "sigmoid":
            scores = logits.sigmoid()
            choice = scores if bias is None else scores + bias.float()
            if self.grouped:
                group_scores = self._groups(choice).topk(2, dim=-1)[0].sum(dim=-1)
                choice = choice.masked_fill(
                    ~self._group_mask(group_scores, choice.shape[-1]), float("-inf")
                )
            ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, ids)
            if self.renormalize:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
            if self.grouped:
                group_scores = self._groups(scores).max(dim=-1).values
                scores = scores.masked_fill(~self._group_mask(group_scores, scores.shape[-1]), 0.0)
            weights, ids = torch.topk(scores, k=self.top_k, dim=-1, sorted=not self.grouped)
            if self.renormalize:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.routed_scaling_factor != 1.0:
            weights = weights * self.routed_scaling_factor
        return weights, ids

    def _groups(self, scores: torch.Tensor) -> torch.Tensor:
        """[num_tokens, num_experts] -> [num_tokens, groups, experts per group]."""
        return scores.view(scores.shape[0], self.num_expert_group, -1)

    def _group_mask(self, group_scores: torch.Tensor, num_experts: int) -> torch.Tensor:
        """[num_tokens, num_experts] bool: the experts of each token's topk_group best groups."""
        best = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        per_group = num_experts // self.num_expert_group
        return mask.unsqueeze(-1).expand(-1, -1, per_group).reshape(-1, num_experts)
