"""How many KV-cache blocks to allocate: given (`num_blocks`), from a byte budget
(`cache_bytes`, the CLI's --kv-cache-memory), or sized from the device's memory when neither
is set. Computed once, before the weights load, by LLMEngine; the runner allocates it.
Then max_model_len, which must fit in it (resolve_max_model_len).

Auto sizing (cache_bytes=None):
- CPU: min(CPU_MAX_AUTO_BYTES, CPU_AUTO_SHARE of MemAvailable after the weights, room for
  twice max_num_seqs sequences of max_model_len): a cache that leaves the rest of the machine
  alone and is not larger than the engine can use (a tiny model's 4 GiB cache was half a
  million blocks of bookkeeping).
- CUDA: vLLM's rule, gpu_memory_utilization x total device memory, less what is already in
  use, the weights and the activations of the largest step (estimated from
  max_num_batched_tokens; profiling a forward is the next refinement, once on a GPU).
"""
from __future__ import annotations

import logging

import torch

from .config import EngineConfig
from .cpu_allocator import available_memory_bytes
from .models import ModelArch

log = logging.getLogger("engine")

CPU_MAX_AUTO_BYTES = 4 << 30
CPU_AUTO_SHARE = 0.5
# Live activations of one step per batched token, in elements: the residual stream, q/k/v,
# the MLP's gate/up output and its product (hidden * 4 + intermediate * 3, rounded up).
_ACTIVATION_FACTOR = 2.0


def weight_bytes(config: EngineConfig, arch: ModelArch) -> int:
    return arch.num_params * (torch.finfo(config.torch_dtype).bits // 8)


def activation_bytes(config: EngineConfig, arch: ModelArch) -> int:
    """The largest step's activations: max_num_batched_tokens rows of the widest tensors,
    plus the logits of max_num_seqs sampled rows in float32."""
    elem = torch.finfo(config.torch_dtype).bits // 8
    tokens = config.scheduler.max_num_batched_tokens
    per_token = (4 * arch.hidden_size + 3 * arch.intermediate_size) * elem
    logits = config.scheduler.max_num_seqs * arch.vocab_size * 4 * 3  # logits, probs, work
    return int(_ACTIVATION_FACTOR * tokens * per_token) + logits


def cuda_cache_bytes(total: int, free: int, weights: int, activations: int,
                     utilization: float) -> int:
    """Before the weights load: utilization x total, less what others use (total - free),
    the weights and the activations."""
    return int(utilization * total) - (total - free) - weights - activations


def auto_cache_bytes(config: EngineConfig, arch: ModelArch) -> int:
    weights = weight_bytes(config, arch)
    device = torch.device(config.device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = cuda_cache_bytes(total, free, weights, activation_bytes(config, arch),
                                  config.cache.gpu_memory_utilization)
        where = (f"{config.cache.gpu_memory_utilization:g} x {total / 2**30:.1f} GiB of "
                 f"{device}")
    else:
        available = available_memory_bytes()
        if available is None:
            return CPU_MAX_AUTO_BYTES // 4
        useful = (2 * config.scheduler.max_num_seqs * arch.kv_bytes_per_token(config.torch_dtype)
                  * (config.scheduler.max_model_len or arch.max_position_embeddings))
        budget = min(CPU_MAX_AUTO_BYTES, useful, int(CPU_AUTO_SHARE * (available - weights)))
        where = f"{available / 2**30:.1f} GiB of available memory"
    if budget <= 0:
        raise ValueError(f"no memory is left for the KV cache in {where} after "
                         f"{weights / 2**30:.2f} GiB of weights; set kv-cache-memory / "
                         f"num_blocks, or free memory")
    return budget


def num_cache_blocks(config: EngineConfig, arch: ModelArch) -> int:
    if config.cache.num_blocks is not None:
        return config.cache.num_blocks
    per_block = arch.kv_bytes_per_token(config.torch_dtype) * config.cache.block_size
    budget = config.cache.cache_bytes
    if budget is None:
        budget = auto_cache_bytes(config, arch)
    blocks = budget // per_block
    if blocks < 1:
        raise ValueError(f"the KV cache budget ({budget} bytes) holds no block of "
                         f"{per_block} bytes; raise cache_bytes")
    return blocks


def check_cache_fits_memory(num_blocks: int, config: EngineConfig, arch: ModelArch) -> None:
    """A CPU cache larger than the memory left after the weights fails here with a message,
    not later in the kernel's OOM killer."""
    need = num_blocks * config.cache.block_size * arch.kv_bytes_per_token(config.torch_dtype)
    available = available_memory_bytes()
    if available is not None and need > available:
        raise ValueError(
            f"the KV cache (cache_bytes / num_blocks) needs {need / 2**30:.2f} GiB but only "
            f"{available / 2**30:.2f} GiB of memory is available; lower cache_bytes")


def resolve_max_model_len(config: EngineConfig, arch: ModelArch, blocks: int) -> int:
    """The longest sequence served: --max-model-len, else the model's positions, capped by
    what the KV cache holds (one sequence of max_model_len must always fit, so a request
    alone can always finish). Refuses, in one line, a max_model_len the cache cannot hold and
    a sliding-window model past its window (this engine attends to the whole context)."""
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
    window = arch.sliding_window
    if window is not None and window < max_model_len:
        raise ValueError(f"{arch.architecture} uses sliding-window attention (window {window}), "
                         f"which this engine does not implement: serve it with max_model_len "
                         f"<= {window} (got {max_model_len})")
    return max_model_len
