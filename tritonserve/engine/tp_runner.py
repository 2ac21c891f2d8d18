"""Tensor parallelism's executor, as vLLM's multiprocess one: rank 0 (this process) schedules,
prepares each step's inputs and sends them to the workers (ranks 1..N-1, spawned processes,
or started by torchrun: `worker_loop`) with one broadcast; every rank runs the forward on its
share of the model (engine/parallel.py), meeting at the all-reduces after o and down; only
rank 0 computes logits and samples. The interface is ModelRunner's (LLMEngine cannot tell).

A worker that dies ends the engine: its closed socket fails rank 0's next collective, and a
watcher thread notices the exit while the engine idles (`check_health`, which the server's
engine loop calls), so /health turns 503 and every stream ends with an error event. A worker
that hangs fails the collective after parallel.COLLECTIVE_TIMEOUT_S (or the server's step
watchdog first).

Messages (rank 0 -> all): first the all-reduce ("shm", path, capacity) or ("group",), then
("allocate", num_blocks, max_model_len), ("profile",
max_model_len), ("forward", ModelInput without its Request objects), ("stop",).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .config import EngineConfig
from .default_model import gguf_source
from .model_runner import ModelRunner
from .models import ModelArch
from .parallel import Shard, exit_process, free_port, join, local_arch, pin_cores
from .resolve import resolved
from .scheduler import SchedulerOutput
from .shm_allreduce import ShmAllReduce

log = logging.getLogger("tritonserve.engine")

SHM_CAPACITY = 16 << 20  # bytes a rank's slot: a 8192-token bf16 prefill of hidden 1024
USE_SHM = True  # False: the group's all-reduce on one machine too (bench tp-cost's gloo rows)


class WorkerDiedError(RuntimeError):
    pass


def _send(message: tuple) -> tuple:
    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    device = torch.device(config.device)
    if device.type == "cuda":  # one GPU a rank
        return dataclasses.replace(config, device=f"cuda:{rank}")
    return config


def _with_reducer(shard: Shard, setup: tuple) -> Shard:
    """The shard with the all-reduce rank 0 chose (("shm", path, capacity) or ("group",));
    every rank has opened the mapping when this returns (the barrier)."""
    shm = None
    if setup[0] == "shm":
        shm = ShmAllReduce(setup[1], shard.rank, shard.size, setup[2], create=False,
                           should_stop=_parent_gone()) if shard.rank else setup[3]
    dist.barrier()
    return dataclasses.replace(shard, shm=shm)


def _parent_gone():
    """A worker's check while it waits in the shared-memory all-reduce: the process that
    spawned it has gone (re-parented), so rank 0 will never arrive."""
    parent = os.getppid()
    return lambda: "rank 0's process has gone" if os.getppid() != parent else None


def worker_loop(config: EngineConfig, arch: ModelArch, folder: Path | None,
                max_positions: int, gguf: Path | None, shard: Shard) -> None:
    """A worker rank, after join(): its share of the model, then the messages until stop."""
    shard = _with_reducer(shard, _send(None))
    runner = ModelRunner(_rank_config(config, shard.rank), local_arch(arch, shard.size),
                         folder, max_positions, gguf, shard)
    while True:
        message = _send(None)
        kind = message[0]
        if kind == "forward":
            runner.forward_only(message[1])
        elif kind == "allocate":
            runner.allocate(*message[1:])
        elif kind == "profile":
            runner.profile_peak_bytes(*message[1:])
        elif kind == "stop":
            break
    dist.destroy_process_group()


def _spawned(config, arch, folder, max_positions, gguf, shard, init_method) -> None:
    pin_cores(shard.rank, shard.size)
    join(shard, config.device, init_method)
    worker_loop(config, arch, folder, max_positions, gguf, shard)
    exit_process(0)


class TensorParallelRunner:
    """ModelRunner's interface over tensor_parallel_size ranks; this process is rank 0."""

    def __init__(self, config: EngineConfig, arch: ModelArch, folder: Path | None,
                 max_positions: int, gguf: Path | None = None,
                 init_method: str | None = None) -> None:
        """init_method: where the ranks meet (tcp://host:port); None spawns the workers here
        on a free loopback port. Given, the workers are started elsewhere (torchrun)."""
        size = config.tensor_parallel_size
        local = local_arch(arch, size)  # refuses a model that does not divide, before spawning
        shard = Shard(0, size)
        self._affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        self._threads = torch.get_num_threads()
        self.workers: list[mp.Process] = []
        self.dead: str | None = None
        on_one_machine = init_method is None or (
            os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE"))
        if init_method is None:
            init_method = f"tcp://127.0.0.1:{free_port()}"
            context = mp.get_context("spawn")
            for rank in range(1, size):
                proc = context.Process(target=_spawned, daemon=True, args=(
                    config, arch, folder, max_positions, gguf, Shard(rank, size), init_method))
                proc.start()
                self.workers.append(proc)
        if torch.device(config.device).type == "cpu":
            pin_cores(*_local_rank(shard))
        join(shard, config.device, init_method)
        shard = self._reducer(config, shard, on_one_machine)
        self.shard = shard
        self.local = ModelRunner(_rank_config(config, 0), local, folder, max_positions, gguf,
                                 shard)
        self.plan = self.local.plan
        self._stopped = False
        threading.Thread(target=self._watch, daemon=True, name="tp-watch").start()

    def _reducer(self, config: EngineConfig, shard: Shard, on_one_machine: bool) -> Shard:
        """Shared memory for ranks on this machine's CPU (SHM_CAPACITY a slot, larger
        tensors in pieces), the group's all-reduce otherwise; the file is unlinked once every
        rank has mapped it."""
        if torch.device(config.device).type != "cpu" or not on_one_machine or not USE_SHM:
            return _with_reducer(shard, _send(("group",)))
        shm = ShmAllReduce.create(shard.size, SHM_CAPACITY)
        shm.should_stop = lambda: self.dead
        try:
            return _with_reducer(shard, _send(("shm", shm.path, SHM_CAPACITY)) + (shm,))
        finally:
            os.unlink(shm.path)

    def _watch(self) -> None:
        while not self._stopped and self.dead is None:
            for rank, proc in enumerate(self.workers, start=1):
                if not proc.is_alive():
                    self.dead = f"tensor-parallel worker rank {rank} exited ({proc.exitcode})"
                    log.critical("%s", self.dead)
            time.sleep(0.2)

    # ---- ModelRunner's interface -------------------------------------------------------
    def __getattr__(self, name):  # block_size, num_blocks, kv_caches, ... of rank 0
        if "local" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["local"], name)

    def kernels_in_use(self) -> str:
        return (f"{self.local.kernels_in_use()}, tensor parallel "
                f"{self.config.tensor_parallel_size} (all-reduce over {self.shard.reduce_by})")

    def check_health(self) -> None:
        if self.dead is not None:
            raise WorkerDiedError(self.dead)

    def is_device_fatal(self, exc: BaseException) -> bool:
        """A failure while the ranks meet (the broadcast, the forward's all-reduces) ends the
        engine: they are out of step (`dead` says so). One before (preparing the inputs) or
        after (rank 0's logits and draw: a request's grammar, a sampling fault) leaves them in
        step: that batch fails and the engine goes on, as with one process."""
        return self.dead is not None or self.local.is_device_fatal(exc)

    def profile_peak_bytes(self, max_model_len: int) -> int:
        self._broadcast(("profile", max_model_len))
        return self.local.profile_peak_bytes(max_model_len)

    def allocate(self, num_blocks: int, max_model_len: int) -> None:
        self._broadcast(("allocate", num_blocks, max_model_len))
        self.local.allocate(num_blocks, max_model_len)

    def release(self, request_id: str) -> None:
        self.local.release(request_id)

    @torch.inference_mode()
    def execute(self, schedule: SchedulerOutput) -> dict:
        model_input = self.local.prepare(schedule.scheduled)
        masks = self.local.sampler.start_masks(model_input.sample_requests)
        try:
            self._broadcast(("forward", dataclasses.replace(model_input, sample_requests=[],
                                                                 spec=(), prompt_rows=(),
                                                                 pool_rows=())))
            hidden = self.local.forward(model_input)
        except Exception as exc:
            self.dead = self.dead or f"{type(exc).__name__}: {exc}"  # the ranks are out of step
            raise
        return self.local.sample(model_input, hidden, masks)

    def _broadcast(self, message: tuple) -> None:
        self.check_health()
        _send(message)

    def shutdown(self) -> None:
        """Stops the workers and leaves the group; this process's cores and threads as they
        were before rank 0 took its share."""
        if self._stopped:
            return
        self._stopped = True
        if self.dead is None:
            try:
                _send(("stop",))
            except RuntimeError:
                pass
        for proc in self.workers:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        if self._affinity is not None:
            os.sched_setaffinity(0, self._affinity)
        torch.set_num_threads(self._threads)


def make_runner(config: EngineConfig, arch: ModelArch, folder: Path | None,
                max_positions: int, gguf: Path | None):
    """ModelRunner, or TensorParallelRunner for tensor_parallel_size > 1 (ranks from torchrun
    when its RANK / WORLD_SIZE / MASTER_ADDR are set: this is rank 0 then)."""
    if config.tensor_parallel_size == 1:
        return ModelRunner(config, arch, folder, max_positions, gguf)
    init_method = None
    if os.environ.get("WORLD_SIZE") and os.environ.get("MASTER_ADDR"):
        init_method = _torchrun_init()
    return TensorParallelRunner(config, arch, folder, max_positions, gguf, init_method)


def serve_rank(config: EngineConfig, rank: int) -> int:
    """A worker rank started by torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): the
    same config as rank 0's server, resolved alike; returns when rank 0 stops it."""

    size = config.tensor_parallel_size
    if int(os.environ.get("WORLD_SIZE", size)) != size:
        raise ValueError(f"tensor_parallel_size {size} but torchrun's WORLD_SIZE is "
                         f"{os.environ.get('WORLD_SIZE')}")
    folder, arch, config, max_positions = resolved(config)
    shard = Shard(rank, size)
    if torch.device(config.device).type == "cpu":
        pin_cores(*_local_rank(shard))
    join(shard, config.device, _torchrun_init())
    worker_loop(config, arch, folder, max_positions, gguf_source(folder), shard)
    return 0


def _torchrun_init() -> str:
    """torchrun's agent already hosts the store at MASTER_ADDR:MASTER_PORT: env:// joins it
    (a tcp:// of the same address would try to bind the port again on rank 0)."""
    return "env://"


def _local_rank(shard: Shard) -> tuple[int, int]:
    """The rank's place among the ranks of this machine, (rank, size) (torchrun's LOCAL_RANK /
    LOCAL_WORLD_SIZE; spawned workers are all here): what its share of the cores is."""
    if "LOCAL_RANK" in os.environ and "LOCAL_WORLD_SIZE" in os.environ:
        return int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    return shard.rank, shard.size
