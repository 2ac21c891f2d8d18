"""Where each data-parallel engine process goes: its share of the CPU's KV-cache budget and,
on CUDA, the devices it sees (server/dp_engine.py starts them)."""
from __future__ import annotations

import dataclasses

from tritonserve.engine.config import EngineConfig
from tritonserve.engine.memory import cpu_cache_bytes
from tritonserve.engine.resolve import resolved


def split_cache(config: EngineConfig, size: int) -> EngineConfig:
    """The CPU's automatic KV-cache budget (engine/memory.cpu_cache_bytes) is a share of the
    machine's free memory: sized once here and divided, or N engines starting together would
    each take the share."""
    if size == 1 or config.device != "cpu" or config.cache.num_blocks is not None \
            or config.cache.cache_bytes is not None:
        return config
    _, arch, resolved_config, _ = resolved(config)
    budget = cpu_cache_bytes(resolved_config, arch) // size
    return dataclasses.replace(config, cache=dataclasses.replace(config.cache,
                                                                 cache_bytes=budget))


def devices_for(config: EngineConfig, index: int, size: int,
                count: int | None = None) -> str | None:
    """CUDA: the devices engine `index` sees (CUDA_VISIBLE_DEVICES), tensor_parallel_size of
    them each, as vLLM's data-parallel ranks; None on the CPU."""
    if not config.device.startswith("cuda"):
        return None
    tp = config.tensor_parallel_size
    if count is None:
        import torch
        count = torch.cuda.device_count()
    if count < size * tp:
        raise ValueError(f"data_parallel_size {size} x tensor_parallel_size {tp} needs "
                         f"{size * tp} GPUs; this machine has {count}")
    return ",".join(str(d) for d in range(index * tp, (index + 1) * tp))
