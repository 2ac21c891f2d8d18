"""engine/shm_allreduce.py: ranks (threads here, processes in the engine) summing through one
shared mapping: every rank gets the sum, bit-identical across ranks, for tensors larger than
a slot too; a rank that never arrives ends the wait with PeerGone."""
from __future__ import annotations

import threading

import pytest
import torch

from tritonserve.engine.shm_allreduce import PeerGone, ShmAllReduce


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ranks_get_the_same_sum(dtype):
    first = ShmAllReduce.create(3, capacity=256)  # 64 fp32: the 100-wide rows go in pieces
    ranks = [first] + [ShmAllReduce(first.path, r, 3, 256) for r in (1, 2)]
    gen = torch.Generator().manual_seed(0)
    inputs = [[torch.randn(n, generator=gen).to(dtype) for n in (5, 100, 64, 1)]
              for _ in range(3)]
    outputs = [[t.clone() for t in row] for row in inputs]

    def rank(r):
        for t in outputs[r]:
            ranks[r].all_reduce(t)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for i in range(4):
        want = inputs[0][i].clone()
        for r in (1, 2):
            want += inputs[r][i]  # rank order, in the dtype
        for r in range(3):
            assert torch.equal(outputs[r][i], want)
    for shm in ranks:
        shm.close()
    first.close(unlink=True)


def test_a_rank_that_never_arrives_ends_the_wait():
    shm = ShmAllReduce.create(2, capacity=64)
    shm.should_stop = lambda: "rank 1 exited"
    with pytest.raises(PeerGone, match="rank 1 exited"):
        shm.all_reduce(torch.ones(4))
    shm.should_stop, shm.wait_limit_s = (lambda: None), 0.2
    with pytest.raises(PeerGone, match="did not reach the all-reduce"):
        shm.all_reduce(torch.ones(4))
    shm.close(unlink=True)
