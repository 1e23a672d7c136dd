"""ShmCommunicator: all-reduce and gather between the ranks of one node through shared memory.

Gloo over loopback TCP costs 1-2 ms per all-reduce here, even for a few kilobytes, and a
tensor-parallel decode step makes two per layer. Ranks on the same node instead exchange through
one mapped file in /dev/shm (unlinked as soon as every rank has it open, so nothing is left behind
if a process is killed):

    byte layout (W = world size, C = slot capacity in bytes, a multiple of 64)
    [0, 64 * W)                   one 64-byte line per rank: int64 sequence number of the last
                                  call whose data that rank has written (cache-line padded)
    [64 * W, 64 * W + 2 * W * C)  two buffers (call parity) of W slots of C bytes: slot r of
                                  buffer b holds rank r's tensor for calls with seq % 2 == b

A call with sequence number k (every rank counts calls identically, since they run the same
collectives in the same order):
  1. wait until every rank's flag >= k - 1: all of them have finished reading call k - 2, which
     used the same buffer, so our slot may be overwritten;
  2. copy our tensor into our slot of buffer k % 2, then store k into our flag. On x86 (TSO) the
     flag store is not visible before the data stores that precede it;
  3. wait until every rank's flag >= k: all data of call k is in place;
  4. read: all-reduce sums the slots in rank order (so every rank gets bitwise the same result);
     gather copies them out on the first rank only.
Tensors larger than C fall back to the process group (the same decision on every rank, since
every rank sees the same sizes).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import socket
import time
import uuid

import numpy as np
import torch

from llmctl.engine import envs

_LINE = 64
_NAME_BYTES = 32  # a uuid4's hex
_SPIN = 2000  # flag checks before yielding the CPU
_TIMEOUT_S = 300.0


def host_id(hostname: str) -> int:
    """A host name as an int64 that ranks can all-gather as a tensor (equal names, equal ids)."""
    digest = hashlib.sha256(hostname.encode()).digest()
    return int.from_bytes(digest[:8], "little", signed=True)


class ShmCommunicator:
    def __init__(self, cpu_group, rank_in_group: int, world_size: int, capacity: int = 0):
        import torch.distributed as dist

        self.rank = rank_in_group
        self.world = world_size
        self.capacity = (capacity or envs.LLMCTL_SHM_SLOT_BYTES) // _LINE * _LINE
        size = _LINE * world_size + 2 * world_size * self.capacity
        # The first rank creates the file; the others open it by name; then it is unlinked.
        # The file's name, as bytes in a tensor (nothing received is unpickled).
        name = torch.zeros(_NAME_BYTES, dtype=torch.uint8)
        if rank_in_group == 0:
            name[:] = torch.frombuffer(bytearray(uuid.uuid4().hex.encode()), dtype=torch.uint8)
        dist.broadcast(name, src=dist.get_global_rank(cpu_group, 0), group=cpu_group)
        path = f"/dev/shm/llmctl-{bytes(name.tolist()).decode('ascii')}"
        if rank_in_group == 0:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, size)
        dist.barrier(group=cpu_group)
        if rank_in_group != 0:
            fd = os.open(path, os.O_RDWR)
        self._map = mmap.mmap(fd, size)
        os.close(fd)
        dist.barrier(group=cpu_group)
        if rank_in_group == 0:
            os.unlink(path)  # every rank has it mapped; the memory lives until the last unmaps
        raw = np.frombuffer(self._map, dtype=np.uint8)
        self._flags = np.frombuffer(self._map, dtype=np.int64, count=world_size * 8)[::8]
        self._data = torch.from_numpy(raw[_LINE * world_size :])
        self._seq = 0
        self.hostname = socket.gethostname()

    def fits(self, tensor: torch.Tensor) -> bool:
        return tensor.numel() * tensor.element_size() <= self.capacity

    def _slot(self, buffer: int, rank: int, tensor: torch.Tensor, numel: int) -> torch.Tensor:
        start = (buffer * self.world + rank) * self.capacity
        nbytes = numel * tensor.element_size()
        return self._data[start : start + nbytes].view(tensor.dtype)

    def _wait_all(self, seq: int) -> None:
        flags = self._flags
        spins = 0
        deadline = None
        while flags.min() < seq:
            spins += 1
            if spins > _SPIN:
                if deadline is None:
                    deadline = time.monotonic() + _TIMEOUT_S
                elif time.monotonic() > deadline:
                    raise RuntimeError(
                        f"shared-memory collective {seq} timed out: a peer rank stopped"
                    )
                os.sched_yield()

    def _publish(self, tensor: torch.Tensor) -> int:
        self._seq += 1
        seq = self._seq
        self._wait_all(seq - 1)  # step 1: the buffer of call seq - 2 is free
        buffer = seq % 2
        self._slot(buffer, self.rank, tensor, tensor.numel()).copy_(tensor.reshape(-1))
        self._flags[self.rank] = seq  # step 2: after the data (x86 store order)
        self._wait_all(seq)  # step 3
        return buffer

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; identical bits on every rank."""
        buffer = self._publish(tensor)
        flat = tensor.view(-1)
        n = tensor.numel()
        flat.copy_(self._slot(buffer, 0, tensor, n))
        for rank in range(1, self.world):
            flat.add_(self._slot(buffer, rank, tensor, n))
        return tensor

    def gather(self, tensor: torch.Tensor, dim: int, sizes: list[int]) -> torch.Tensor | None:
        """Concatenate the ranks' tensors along `dim` on the first rank (None elsewhere).

        Rank r's tensor has extent sizes[r] along `dim` and the same extent as ours elsewhere.
        """
        buffer = self._publish(tensor.contiguous())
        if self.rank != 0:
            return None
        pieces = []
        for rank, size in enumerate(sizes):
            shape = list(tensor.shape)
            shape[dim] = size
            numel = int(np.prod(shape))
            pieces.append(self._slot(buffer, rank, tensor, numel).view(shape))
        return torch.cat(pieces, dim=dim)

    def close(self) -> None:
        self._data = self._flags = None
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still alive; the mapping goes with the process
