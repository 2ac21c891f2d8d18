"""The all-reduce of tensor-parallel ranks on one machine's CPU through shared memory, as vLLM's
CPU backend does: gloo's all-reduce of one 576-wide bf16 row took 1.3-2.0 ms over loopback
TCP on the 2-core Zen 4 VM (a step of SmolLM2's shape has 60 of them: 112 of a 137 ms step at
batch 1, `tritonserve bench tp-cost`), where the data is a few KB.

Layout of the mapping (a file in /dev/shm, made by rank 0, opened by every rank): one int64
flag a rank, then two buffers (by call parity) of `size` slots of `capacity` bytes. A call:
its generation g += 1; copy the tensor into my slot of buffer g % 2; publish flag = g; wait
until every flag >= g; sum the slots in rank order into the tensor (the same order on every
rank, so every rank holds the same bits). Two buffers suffice: a rank can only write buffer
g % 2 again at call g + 2, after every rank published g + 1, i.e. after each finished
reading g. x86's store order makes the data visible before the flag. Tensors larger than a
slot go in slot-sized pieces, a call each.
"""
from __future__ import annotations

import mmap
import os
import tempfile
import time

import numpy as np
import torch

FLAG_BYTES = 64  # a cache line a flag
SPINS_BEFORE_YIELD = 64


class PeerGone(RuntimeError):
    pass


class ShmAllReduce:
    """should_stop: polled while waiting for the other ranks; a reason it returns (a rank
    known dead) ends the wait with PeerGone, as does a wait longer than wait_limit_s (a dead
    rank leaves no closed socket behind here)."""

    def __init__(self, path: str, rank: int, size: int, capacity: int,
                 create: bool = False, should_stop=lambda: None,
                 wait_limit_s: float = 60.0) -> None:
        self.path, self.rank, self.size, self.capacity = path, rank, size, capacity
        self.should_stop, self.wait_limit_s = should_stop, wait_limit_s
        total = FLAG_BYTES * size + 2 * size * capacity
        if create:
            with open(path, "wb") as f:
                f.truncate(total)
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), total)
        raw = np.frombuffer(self._map, dtype=np.uint8)
        self._flags = [raw[FLAG_BYTES * r:FLAG_BYTES * r + 8].view(np.int64)
                       for r in range(size)]
        body = torch.frombuffer(self._map, dtype=torch.uint8)[FLAG_BYTES * size:]
        self._slots = body.view(2, size, capacity)
        self._generation = 0

    @classmethod
    def create(cls, rank_count: int, capacity: int) -> "ShmAllReduce":
        """Rank 0's: a fresh file (its name then goes to the other ranks)."""
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix="tritonserve-allreduce-", dir=folder)
        os.close(fd)
        return cls(path, 0, rank_count, capacity, create=True)

    def all_reduce(self, t: torch.Tensor) -> None:
        """In place: the sum over ranks, in rank order."""
        flat = t.view(-1)
        step = self.capacity // t.element_size()
        for start in range(0, flat.numel(), step):
            self._reduce(flat[start:start + step])

    def _reduce(self, part: torch.Tensor) -> None:
        self._generation += 1
        g = self._generation
        buffer = self._slots[g % 2]
        nbytes = part.numel() * part.element_size()
        slots = buffer[:, :nbytes].view(part.dtype)  # [size, n]
        slots[self.rank].copy_(part)
        self._flags[self.rank][0] = g
        for r in range(self.size):
            spins, since = 0, None
            while self._flags[r][0] < g:
                spins += 1
                if spins % SPINS_BEFORE_YIELD == 0:
                    time.sleep(0)  # let this core's other threads run
                    reason = self.should_stop()
                    since = since or time.monotonic()
                    if reason is None and time.monotonic() - since > self.wait_limit_s:
                        reason = f"rank {r} did not reach the all-reduce in " \
                                 f"{self.wait_limit_s:.0f} s"
                    if reason is not None:
                        raise PeerGone(reason)
        total = slots[0].clone()
        for r in range(1, self.size):
            total += slots[r]
        part.copy_(total)

    def close(self, unlink: bool = False) -> None:
        self._flags = []
        self._slots = None
        try:
            self._map.close()
        except BufferError:  # a view still alive: the mapping goes with the process
            pass
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
