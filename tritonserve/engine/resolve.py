"""What an engine derives from its config before it loads anything: the model folder, its arch,
the config with its dtype resolved, the RoPE table's length. LLMEngine and every tensor-
parallel worker rank (engine/tp_runner.py) derive them alike from the same config."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from .config import EngineConfig
from .default_model import resolve_model
from .dtype import resolve_dtype
from .models import ModelArch


def resolved(config: EngineConfig) -> tuple[Path, ModelArch, EngineConfig, int]:
    """(model folder, arch, the config with its dtype resolved, RoPE positions): what every
    tensor-parallel rank derives alike from the same config."""
    model_path = resolve_model(config.model)
    arch = ModelArch.from_folder(model_path)
    config = dataclasses.replace(config, dtype=resolve_dtype(config.dtype, arch.torch_dtype,
                                                             config.device))
    return model_path, arch, config, config.scheduler.max_model_len or \
        arch.max_position_embeddings
