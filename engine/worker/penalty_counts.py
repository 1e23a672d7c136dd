"""PenaltyCounts: for each request with penalties, its prompt's tokens and how often it generated
each token, kept on the device.

    prompt_seen [slots, vocab] bool     the request's prompt holds the token
    counts      [slots, vocab] float32  times the request generated the token

A request gets a slot the first time it is sampled with a presence, frequency or repetition
penalty, filled from its tokens so far (once); after each step the tokens just sampled are added
on the device (`record`), so a step stages only the rows' slot numbers: no token lists, whatever
the outputs' lengths. Slot 0 stays empty: rows without penalties point there. A preempted
request keeps its slot (its counts stay right: recomputing does not sample again). The tensors
grow (doubling) with the requests that need a slot at once.
"""

from __future__ import annotations

import numpy as np
import torch


class PenaltyCounts:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.slot_of: dict[str, int] = {}
        self._free: list[int] = []
        self.prompt_seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self.counts = torch.zeros(0, vocab_size, dtype=torch.float32, device=device)

    def slots(self, requests: list[tuple[str, np.ndarray, np.ndarray]], stage) -> list[int]:
        """Each request's slot (req_id, prompt ids, output ids so far): those without one get a
        slot filled from their tokens, all in one go (`stage(name, values)` copies host values
        to the device; each name once per step)."""
        new = [r for r in requests if r[0] not in self.slot_of]
        for req_id, _, _ in new:
            if not self._free:
                self._grow()
            self.slot_of[req_id] = self._free.pop()
        if new:
            slots = np.array([self.slot_of[r] for r, _, _ in new], np.int64)
            fresh = stage("penalty_slots", slots)
            self.prompt_seen.index_fill_(0, fresh, False)
            self.counts.index_fill_(0, fresh, 0.0)
            for name, table, column in (
                ("prompt", self.prompt_seen, 1),
                ("output", self.counts, 2),
            ):
                ids = [np.asarray(r[column], np.int64) for r in new]
                rows = np.repeat(slots, [len(i) for i in ids])
                if len(rows):
                    index = (
                        stage(f"penalty_{name}_rows", rows),
                        stage(f"penalty_{name}_ids", np.concatenate(ids)),
                    )
                    ones = torch.ones(len(rows), dtype=table.dtype, device=self.device)
                    table.index_put_(index, ones, accumulate=table.dtype != torch.bool)
        return [self.slot_of[r] for r, _, _ in requests]

    def rows(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """([num_rows, vocab] prompt_seen, [num_rows, vocab] counts) of these slots."""
        return self.prompt_seen.index_select(0, slots), self.counts.index_select(0, slots)

    def record(self, slots: torch.Tensor, sampled: torch.Tensor) -> None:
        """Add each row's sampled token to its slot's counts (slot 0 rows add nothing)."""
        added = (slots > 0).to(torch.float32)
        self.counts.index_put_((slots, sampled), added, accumulate=True)

    def remove(self, req_id: str) -> None:
        slot = self.slot_of.pop(req_id, None)
        if slot is not None:
            self._free.append(slot)

    def _grow(self) -> None:
        old = self.counts.shape[0]
        new = max(2 * old, 4)
        grow = lambda t: torch.cat([t, t.new_zeros(new - old, self.vocab_size)])  # noqa: E731
        self.prompt_seen, self.counts = grow(self.prompt_seen), grow(self.counts)
        self._free.extend(range(new - 1, max(old, 1) - 1, -1))  # slot 0 is never handed out
