"""How many KV-cache blocks to allocate: given (`num_blocks`), from a byte budget
(`cache_bytes`, the CLI's --kv-cache-memory), or sized from the device's memory when neither
is set. Then max_model_len, which must fit in it (resolve_max_model_len).

Auto sizing (cache_bytes=None):
- CPU, before the weights load: min(CPU_MAX_AUTO_BYTES, CPU_AUTO_SHARE of MemAvailable after
  the weights, room for twice max_num_seqs sequences of max_model_len): a cache that leaves the
  rest of the machine alone and is not larger than the engine can use (a tiny model's 4 GiB
  cache was half a million blocks of bookkeeping).
- CUDA, after the weights load (profiles_cache): vLLM's rule, gpu_memory_utilization x total
  device memory, less what is in use then (weights, context, other processes) and the peak of
  one profiled largest step (ModelRunner.profile_peak_bytes).
"""
from __future__ import annotations

import logging

import torch

from .config import EngineConfig
from .cpu_allocator import available_memory_bytes, keep_buffers_on_heap
from .models import ModelArch
from .models.gguf import served_bytes

log = logging.getLogger("tritonserve.engine")

CPU_MAX_AUTO_BYTES = 4 << 30
CPU_AUTO_SHARE = 0.5


def weight_bytes(config: EngineConfig, arch: ModelArch) -> int:
    return arch.num_params * (torch.finfo(config.torch_dtype).bits // 8)


def check_weights_fit(config: EngineConfig, arch: ModelArch, gguf_file=None) -> None:
    """On the CPU, refuse weights larger than the memory available, naming the sizes: they
    would be paged from disk every step (a mixture's experts most of all: each step reads
    other experts), minutes a token without a word. A GGUF file served as its blocks takes
    about its size (MXFP4 twice its bytes: gguf.served_bytes); anything else its dtype's
    bytes a weight."""
    if config.device != "cpu":
        return
    available = available_memory_bytes()
    if available is None:
        return
    dense = weight_bytes(config, arch)
    served = (served_bytes(gguf_file) if gguf_file is not None
              and config.quantization in ("auto", "gguf") else dense)
    if served <= available:
        return
    experts = arch.expert_params * served // max(arch.num_params, 1)
    of_which = f" ({experts / 2**30:.1f} GiB of them experts)" if experts else ""
    raise ValueError(f"{arch.architecture}: the weights take {served / 2**30:.1f} GiB"
                     f"{of_which} and {available / 2**30:.1f} GiB of memory are available; "
                     f"they would be read from disk every step. Serve a smaller quantization "
                     f"(a GGUF file's Q4_K_M blocks), or free memory")


def cuda_cache_bytes(total: int, free: int, step_peak: int, utilization: float) -> int:
    """After the weights load: utilization x total, less what is in use (total - free: the
    weights, the CUDA context, other processes) and one step's measured peak."""
    return int(utilization * total) - (total - free) - step_peak


def profiles_cache(config: EngineConfig) -> bool:
    """The cache is sized after the weights load, from a profiled step: CUDA, nothing given."""
    return (torch.device(config.device).type == "cuda" and config.cache.num_blocks is None
            and config.cache.cache_bytes is None)


def profiled_cache_blocks(config: EngineConfig, arch: ModelArch, step_peak: int) -> int:
    device = torch.device(config.device)
    free, total = torch.cuda.mem_get_info(device)
    utilization = config.cache.gpu_memory_utilization
    budget = cuda_cache_bytes(total, free, step_peak, utilization)
    log.info("KV cache: %.2f GiB = %g x %.1f GiB - %.2f GiB in use - %.2f GiB step peak",
             max(budget, 0) / 2**30, utilization, total / 2**30, (total - free) / 2**30,
             step_peak / 2**30)
    if budget <= 0:
        raise ValueError(f"no memory is left for the KV cache in {utilization:g} x "
                         f"{total / 2**30:.1f} GiB of {device}: {(total - free) / 2**30:.1f} GiB "
                         f"in use after the weights, a step peaks at {step_peak / 2**30:.2f} "
                         f"GiB; raise gpu_memory_utilization or lower max_num_batched_tokens")
    return blocks_in(budget, config, arch)


def blocks_in(budget: int, config: EngineConfig, arch: ModelArch) -> int:
    per_block = arch.kv_bytes_per_token(config.kv_dtype) * config.cache.block_size
    blocks = budget // per_block
    if blocks < 1:
        raise ValueError(f"the KV cache budget ({budget} bytes) holds no block of "
                         f"{per_block} bytes; raise cache_bytes")
    return blocks


def cpu_cache_bytes(config: EngineConfig, arch: ModelArch) -> int:
    weights = weight_bytes(config, arch)
    available = available_memory_bytes()
    if available is None:
        return CPU_MAX_AUTO_BYTES // 4
    useful = (2 * config.scheduler.max_num_seqs * arch.kv_bytes_per_token(config.kv_dtype)
              * (config.scheduler.max_model_len or arch.max_position_embeddings))
    budget = min(CPU_MAX_AUTO_BYTES, useful, int(CPU_AUTO_SHARE * (available - weights)))
    if budget <= 0:
        raise ValueError(f"no memory is left for the KV cache in {available / 2**30:.1f} GiB of "
                         f"available memory after {weights / 2**30:.2f} GiB of weights; set "
                         f"kv-cache-memory / num_blocks, or free memory")
    return budget


def num_cache_blocks(config: EngineConfig, arch: ModelArch) -> int:
    """Before the weights load: the given size, the byte budget, or the CPU's auto size
    (CUDA's auto size is profiled_cache_blocks, after loading)."""
    if config.cache.num_blocks is not None:
        return config.cache.num_blocks
    budget = config.cache.cache_bytes
    if budget is None:
        budget = cpu_cache_bytes(config, arch)
    return blocks_in(budget, config, arch)


class DeviceMemory:
    """What the engine does with a device's memory, per device: the host allocator's settings,
    a step's measured peak (CUDA; the CPU's cache is sized before the weights), and how the KV
    cache is allocated."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cpu, self.cuda = device.type == "cpu", device.type == "cuda"
        if self.cpu:
            keep_buffers_on_heap()

    def start_peak(self) -> int:
        """Before a profiled step: the bytes in use now (CUDA), peak statistics reset."""
        if not self.cuda:
            return 0
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    def peak_since(self, base: int) -> int:
        """After it: the step's peak beyond `base` (0 off CUDA), the allocator's cache freed."""
        if not self.cuda:
            return 0
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        torch.cuda.empty_cache()
        return peak

    def check_cache_fits(self, num_blocks: int, config: EngineConfig, arch: ModelArch) -> None:
        """The CPU's check before its cache is allocated (CUDA's was sized to fit)."""
        if self.cpu:
            check_cache_fits_memory(num_blocks, config, arch)

    def allocate_cache(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """One K or V cache tensor. No kernel reads a slot past a sequence's length (the kernel
        tests poison those slots with NaN), so the contents need no initialising; on the CPU
        the pages are touched once here all the same: otherwise first-touch page faults land
        inside the decode steps."""
        return (torch.zeros if self.cpu else torch.empty)(shape, dtype=dtype, device=self.device)


def check_cache_fits_memory(num_blocks: int, config: EngineConfig, arch: ModelArch) -> None:
    """A CPU cache larger than the memory left after the weights fails here with a message,
    not later in the kernel's OOM killer."""
    need = num_blocks * config.cache.block_size * arch.kv_bytes_per_token(config.kv_dtype)
    available = available_memory_bytes()
    if available is not None and need > available:
        raise ValueError(
            f"the KV cache (cache_bytes / num_blocks) needs {need / 2**30:.2f} GiB but only "
            f"{available / 2**30:.2f} GiB of memory is available; lower cache_bytes")


def resolve_max_model_len(config: EngineConfig, arch: ModelArch, blocks: int) -> int:
    """The longest sequence served: --max-model-len, else the model's positions, capped by
    what the KV cache holds (one sequence of max_model_len must always fit, so a request
    alone can always finish). Refuses, in one line, a max_model_len the cache cannot hold."""
    positions = arch.max_position_embeddings
    capacity = blocks * config.cache.block_size
    wanted = config.scheduler.max_model_len
    if wanted is not None and wanted > positions:
        raise ValueError(f"max_model_len {wanted} exceeds the model's "
                         f"max_position_embeddings {positions}")
    if wanted is not None and wanted > capacity:
        raise ValueError(f"max_model_len {wanted} does not fit the KV cache ({blocks} blocks of "
                         f"{config.cache.block_size} = {capacity} tokens): raise cache_bytes / "
                         f"num_blocks or lower max_model_len")
    max_model_len = wanted or min(positions, capacity)
    if wanted is None and capacity < positions:
        log.info("max_model_len %d (the KV cache's %d blocks; the model has %d positions)",
                 max_model_len, blocks, positions)
    return max_model_len
