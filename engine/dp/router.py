"""DPRouter: which data-parallel replica gets a request. Pure Python: no threads, no I/O.

A replica's load is its outstanding work in tokens: for each request routed to it and not yet
finished, the prompt tokens it has still to prefill plus the tokens it may still generate
(`max_tokens` less those generated). A request goes to the live replica where it costs least:

    cost(r) = load(r) - cached_token_weight x (prompt tokens cached on r)

A prompt's cached part on a replica is the longest run of its leading full KV blocks (the prefix
cache's unit, `block_size` tokens) that an earlier prompt routed there shared. So a prompt whose
prefix a replica holds goes there unless that replica is busier than the least busy one by more
than `cached_token_weight` (4) tokens of work per cached token: a cached token skips its prefill,
which would also have taken a share of every step's token budget from the replica's running
requests, while outstanding decode tokens of others are shared out over batched steps. Ties go
to the lowest replica index. The router remembers the
last `max_prefix_entries` block hashes (least recently used forgotten first), an estimate of what
the replicas' caches hold; a replica that evicted a block costs one prefill, never a wrong result.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from llmctl.engine.errors import EngineDeadError


@dataclass
class _Routed:
    replica: int
    prompt_left: int  # prompt tokens not yet prefilled (0 after the first output)
    max_tokens: int  # tokens it may generate in all
    generated: int = 0

    @property
    def decode_left(self) -> int:
        return max(0, self.max_tokens - self.generated)

    @property
    def load(self) -> int:
        return self.prompt_left + self.decode_left


class DPRouter:
    def __init__(
        self,
        num_replicas: int,
        block_size: int,
        *,
        cached_token_weight: float = 4.0,
        max_prefix_entries: int = 65536,
    ) -> None:
        self.num_replicas = num_replicas
        self.cached_token_weight = cached_token_weight
        self.block_size = block_size
        self.max_prefix_entries = max_prefix_entries
        self.loads = [0] * num_replicas
        self.dead: dict[int, str] = {}  # replica -> why it stopped
        self.routed_count = [0] * num_replicas  # requests routed to each replica, ever
        self._requests: dict[str, _Routed] = {}
        # block-chain hash -> replicas that prefilled a prompt with this prefix
        self._prefixes: OrderedDict[int, set[int]] = OrderedDict()

    @property
    def live(self) -> list[int]:
        return [r for r in range(self.num_replicas) if r not in self.dead]

    def block_hashes(self, prompt_ids: list[int]) -> list[int]:
        """One hash per full leading block, each chained on the previous (as the KV cache's)."""
        hashes, parent = [], None
        bs = self.block_size
        for start in range(0, len(prompt_ids) - bs + 1, bs):
            parent = hash((parent, tuple(prompt_ids[start : start + bs])))
            hashes.append(parent)
        return hashes

    def cached_tokens(self, prompt_ids: list[int]) -> list[int]:
        """Per replica: how many leading tokens of the prompt it is thought to have cached."""
        cached = [0] * self.num_replicas
        holders = set(range(self.num_replicas))
        for i, h in enumerate(self.block_hashes(prompt_ids)):
            holders &= self._prefixes.get(h, set())
            if not holders:
                break
            for r in holders:
                cached[r] = (i + 1) * self.block_size
        return cached

    def choose(self, prompt_ids: list[int]) -> int:
        """The live replica where the prompt costs least (see the module docstring)."""
        live = self.live
        if not live:
            raise self.none_live_error()
        cached = self.cached_tokens(prompt_ids)
        weight = self.cached_token_weight
        return min(live, key=lambda r: (self.loads[r] - weight * cached[r], r))

    def add(self, request_id: str, replica: int, prompt_ids: list[int], max_tokens: int) -> None:
        """Count a request routed to `replica` (its prompt's blocks now cached there)."""
        cached = self.cached_tokens(prompt_ids)[replica]
        routed = _Routed(replica, len(prompt_ids) - cached, max_tokens)
        self._requests[request_id] = routed
        self.loads[replica] += routed.load
        self.routed_count[replica] += 1
        for h in self.block_hashes(prompt_ids):
            self._prefixes.setdefault(h, set()).add(replica)
            self._prefixes.move_to_end(h)
        while len(self._prefixes) > self.max_prefix_entries:
            self._prefixes.popitem(last=False)

    def route(self, request_id: str, prompt_ids: list[int], max_tokens: int) -> int:
        """choose() then add(): the replica that takes the request."""
        replica = self.choose(prompt_ids)
        self.add(request_id, replica, prompt_ids, max_tokens)
        return replica

    def progress(self, request_id: str, generated: int) -> None:
        """The request has produced `generated` tokens so far (its prompt is prefilled)."""
        routed = self._requests.get(request_id)
        if routed is None:
            return
        before = routed.load
        routed.prompt_left = 0
        routed.generated = generated
        self.loads[routed.replica] -= before - routed.load

    def finish(self, request_id: str) -> None:
        """The request finished, failed or was aborted: its work is no longer outstanding."""
        routed = self._requests.pop(request_id, None)
        if routed is not None:
            self.loads[routed.replica] -= routed.load

    def none_live_error(self) -> EngineDeadError:
        reasons = "; ".join(f"replica {r}: {why}" for r, why in sorted(self.dead.items()))
        return EngineDeadError(
            f"every data-parallel replica stopped ({reasons})", "restart the server"
        )

    def mark_dead(self, replica: int, reason: str) -> None:
        """Route nothing more to `replica`; forget what it cached."""
        self.dead.setdefault(replica, reason)
        for holders in self._prefixes.values():
            holders.discard(replica)

    def revive(self, replica: int) -> None:
        """`replica` serves again (restarted: --restart-on-failure), its cache empty: route to it
        as to any other. Its requests that failed were finished, so its load is theirs no more."""
        self.dead.pop(replica, None)

    def replica_of(self, request_id: str) -> int | None:
        routed = self._requests.get(request_id)
        return None if routed is None else routed.replica
