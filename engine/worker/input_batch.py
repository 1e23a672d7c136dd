"""InputBatch: the worker's persistent per-request state, one row per request, in host arrays.

A request gets a row when it arrives whole (NewRequestData) and keeps it until it finishes; each
later step only appends to it (sampled tokens, new block ids) and moves its computed count. The
model runner reads a step's inputs out of these rows with vectorised gathers (no per-token Python),
into StagedBuffer host arrays that it copies to the device once per step.

    token_ids     [max_num_reqs, max_model_len] int32: prompt, then sampled tokens
    block_tables  per KV cache group, [max_num_reqs, max_blocks_per_req] int64: a request's KV
                  blocks in that group, in order (config/kv_cache_layout.py)
    num_tokens, num_prompt_tokens, num_computed_tokens: [max_num_reqs] int64
    num_blocks    [max_num_reqs, num_groups] int64
    sampling columns (temperature, top_k, min_tokens, has_penalties, ...): [max_num_reqs], set
        once when the row is filled, so a step reads its rows' settings with vectorised gathers

Rows are allocated from a free list, so a step's requests are a list of row indices, not a
contiguous range; the table grows (doubling) if more requests are live than it was sized for
(pipeline parallelism keeps several batches in flight).
"""

from __future__ import annotations

import numpy as np
import torch

from llmctl.engine.sampling_params import SamplingParams


class StagedBuffer:
    """A host array and its device twin of the same maximal shape (flat).

    A step writes the host side through `.np` and `copy(n)` sends the first n elements to the
    device with one copy, returning the device view. On the CPU the two are the same tensor. On
    CUDA the host side is pinned, so the copy is asynchronous; ModelRunner waits for the last
    step's copies before it writes the host side again.
    """

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.host = torch.zeros(size, dtype=dtype, pin_memory=pin)
        self.np = self.host.numpy()
        on_host = device.type == "cpu"
        self.device = self.host if on_host else torch.zeros(size, dtype=dtype, device=device)

    def copy(self, n: int) -> torch.Tensor:
        if self.device is self.host:
            return self.host[:n]
        out = self.device[:n]
        out.copy_(self.host[:n], non_blocking=True)
        return out


class InputBatch:
    def __init__(
        self, max_num_reqs: int, max_model_len: int, block_size: int, num_groups: int = 1
    ) -> None:
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_groups = num_groups
        self.block_tables: list[np.ndarray] = []
        self.max_blocks_per_req = -(-max_model_len // block_size)
        self.req_ids: list[str | None] = []
        self.row_of: dict[str, int] = {}
        # (group, row, first column, block ids) written since the model runner last read them:
        # what it copies to its device-resident block tables (O(new blocks) per step).
        self.new_blocks: list[tuple[int, int, int, list[int]]] = []
        self._free: list[int] = []
        self.sampling_params: list[SamplingParams | None] = []
        self._allocate(max(max_num_reqs, 1))

    # -- rows -------------------------------------------------------------------------------------

    def _allocate(self, rows: int) -> None:
        old = len(self.req_ids)

        def grow(array: np.ndarray | None, shape: tuple, dtype) -> np.ndarray:
            new = np.zeros(shape, dtype=dtype)
            if array is not None:
                new[:old] = array
            return new

        cols, blocks = self.max_model_len, self.max_blocks_per_req
        get = self.__dict__.get
        self.token_ids = grow(get("token_ids"), (rows, cols), np.int32)
        self.block_tables = [
            grow(table, (rows, blocks), np.int64)
            for table in self.block_tables or [None] * self.num_groups
        ]
        for name in ("num_tokens", "num_prompt_tokens", "num_computed_tokens"):
            setattr(self, name, grow(get(name), (rows,), np.int64))
        self.num_blocks = grow(get("num_blocks"), (rows, self.num_groups), np.int64)
        for name in ("temperature", "top_p", "min_p", "presence", "frequency", "repetition"):
            setattr(self, name, grow(get(name), (rows,), np.float32))
        self.top_k = grow(get("top_k"), (rows,), np.int64)
        self.min_tokens = grow(get("min_tokens"), (rows,), np.int64)
        self.logprobs = grow(get("logprobs"), (rows,), np.int64)  # -1: none asked
        for name in ("greedy", "has_stop_ids", "has_logit_bias", "has_penalties"):
            setattr(self, name, grow(get(name), (rows,), np.bool_))
        self.req_ids.extend([None] * (rows - old))
        self.sampling_params.extend([None] * (rows - old))
        self._free.extend(range(rows - 1, old - 1, -1))  # pop() hands out low rows first

    def add_request(
        self,
        req_id: str,
        token_ids: list[int],
        num_prompt_tokens: int,
        sampling_params: SamplingParams,
        block_ids: list[list[int]],
        num_computed_tokens: int,
        vocab_size: int,
    ) -> None:
        """A new request, or one resumed after preemption (its row is rewritten)."""
        row = self.row_of.get(req_id)
        if row is None:
            if not self._free:
                self._allocate(2 * len(self.req_ids))
            row = self._free.pop()
            self.row_of[req_id] = row
            self.req_ids[row] = req_id
        n = len(token_ids)
        self.token_ids[row, :n] = token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = num_prompt_tokens
        self.num_computed_tokens[row] = num_computed_tokens
        self.num_blocks[row] = 0
        self.append_blocks(row, block_ids)
        p = sampling_params
        self.sampling_params[row] = p
        self.temperature[row] = p.temperature
        self.greedy[row] = p.greedy
        self.top_k[row] = p.top_k or vocab_size
        self.top_p[row] = p.top_p
        self.min_p[row] = p.min_p
        self.presence[row] = p.presence_penalty
        self.frequency[row] = p.frequency_penalty
        self.repetition[row] = p.repetition_penalty
        self.min_tokens[row] = p.min_tokens
        self.logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self.has_stop_ids[row] = bool(p.all_stop_token_ids)
        self.has_logit_bias[row] = bool(p.logit_bias)
        self.has_penalties[row] = p.uses_penalties

    def append_tokens(self, row: int, token_ids: list[int]) -> None:
        start = self.num_tokens[row]
        self.token_ids[row, start : start + len(token_ids)] = token_ids
        self.num_tokens[row] = start + len(token_ids)

    def append_blocks(self, row: int, block_ids: list[list[int]]) -> None:
        """New block ids, per KV cache group."""
        for g, ids in enumerate(block_ids):
            if not ids:
                continue
            start = int(self.num_blocks[row, g])
            self.block_tables[g][row, start : start + len(ids)] = ids
            self.num_blocks[row, g] = start + len(ids)
            self.new_blocks.append((g, row, start, ids))

    def remove_request(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self.req_ids[row] = None
            self.sampling_params[row] = None
            self._free.append(row)
