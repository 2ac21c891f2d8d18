"""Tensor parallelism's pieces on torch.distributed (Megatron's split, as vLLM and SGLang do):
a rank holds num_heads / N query heads, num_kv_heads / N KV heads (and their share of the KV
cache) and intermediate_size / N of the MLP. qkv and gate/up are column-parallel: each of q,
k, v and gate, up is sliced by rank (the loader narrows each checkpoint tensor, never the fused
one); o and down are row-parallel: each rank's product is a partial sum of the whole output,
summed by one all-reduce a projection (`Shard.all_reduce`), so the residual stream, the norms
and the next layer's input are whole on every rank. The embedding and the lm_head are
replicated: a vocab-parallel head would need a gather of the logits before sampling, and only
rank 0 samples; at SmolLM2's size the table is 57 MB (bf16).

The group: gloo on the CPU, NCCL on CUDA (`backend_for`), one init_process_group for both.
Ranks meet at `init_method` (tcp://host:port): spawned by the engine on one machine
(engine/tp_runner.py) or started by torchrun across machines (MASTER_ADDR / MASTER_PORT).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, NoReturn

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # models/loader.py imports Shard from here
    from .models.arch import ModelArch

# A group collective waits this long for a peer before raising. Long: a worker waits in one
# for rank 0's next step however long the server idles; a hung rank is the server's step
# watchdog's to catch, and a dead peer's closed socket raises at once.
COLLECTIVE_TIMEOUT_S = 7 * 24 * 3600


def local_arch(arch: ModelArch, size: int) -> ModelArch:
    """The model one of `size` ranks holds. Raises ValueError naming the counts that do not
    divide (SmolLM2: 9 query / 3 KV heads serve tp 1 or 3)."""
    if size == 1:
        return arch
    experts = arch.variant.experts  # each rank holds a share of every expert's rows
    bad = [f"{name} {count}" for name, count in (
        ("query heads", arch.num_heads), ("KV heads", arch.num_kv_heads),
        ("intermediate_size", arch.intermediate_size),
        ("moe_intermediate_size", experts.intermediate if experts else 0)) if count % size]
    if bad:
        raise ValueError(f"tensor_parallel_size {size} must divide the model's "
                         f"{', '.join(bad)} (query heads {arch.num_heads}, KV heads "
                         f"{arch.num_kv_heads})")
    if experts is not None:
        arch = dataclasses.replace(arch, variant=dataclasses.replace(
            arch.variant, experts=dataclasses.replace(
                experts, intermediate=experts.intermediate // size)))
    return dataclasses.replace(arch, num_heads=arch.num_heads // size,
                               num_kv_heads=arch.num_kv_heads // size,
                               intermediate_size=arch.intermediate_size // size)


@dataclass(frozen=True)
class Shard:
    """This process's place: rank of size (size 1: no group); shm: the shared-memory
    all-reduce when every rank is on this machine's CPU (engine/shm_allreduce.py), else the
    group's (gloo, NCCL)."""

    rank: int = 0
    size: int = 1
    shm: object = dataclasses.field(default=None, compare=False, repr=False)

    def all_reduce(self, t: torch.Tensor) -> None:
        """In place: the sum over ranks (a row-parallel projection's partial products)."""
        if self.shm is not None:
            self.shm.all_reduce(t)
        else:
            dist.all_reduce(t)

    @property
    def reduce_by(self) -> str:
        return "shared memory" if self.shm is not None else dist.get_backend()

    def narrow(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's 1/size of a whole checkpoint tensor along dim."""
        part = tensor.shape[dim] // self.size
        return tensor.narrow(dim, self.rank * part, part)


def backend_for(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def join(shard: Shard, device: str, init_method: str) -> None:
    """init_process_group for this rank."""
    dist.init_process_group(backend_for(device), init_method=init_method, rank=shard.rank,
                            world_size=shard.size,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))


def exit_process(code: int) -> NoReturn:
    """Ends a process that has been a rank, skipping the interpreter's finalization. Gloo's
    thread frees a finished collective's work (and the Python objects of its tensors) when it
    gets to it; one that gets there while the interpreter finalizes dies taking the GIL, inside
    a destructor: std::terminate, SIGABRT ("terminate called without an active exception";
    a torchrun rank 1 after a clean stop, 3 of 16 runs with tests/test_tensor_parallel.py's
    torchrun command)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pin_cores(rank: int, size: int) -> int:
    """On the CPU each of `size` ranks (tensor-parallel ranks, or data-parallel engines) gets
    its own cores: a disjoint share of this process's affinity, set for its threads (torch's
    and the C++ library's OpenMP); returns the thread count."""
    try:
        cores = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return torch.get_num_threads()
    share = max(1, len(cores) // size)
    mine = cores[rank * share:(rank + 1) * share] or cores[-share:]
    os.sched_setaffinity(0, mine)
    torch.set_num_threads(len(mine))
    return len(mine)
