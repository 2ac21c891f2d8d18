"""--dtype auto: the model's own dtype (config.json `torch_dtype` / `dtype`), unless this
device cannot run it well. On a CPU without native bf16 (oneDNN's bf16 kernels need AVX-512
BW/VL/DQ, AVX-NE-CONVERT or AMX) bf16 and fp16 fall back to float32, said in one log line: a
bf16 model run in emulated bf16 on such a CPU was several times slower than fp32."""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("tritonserve.engine")

NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def cpu_has_native_bf16() -> bool:
    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return supported is not None and bool(supported())


def resolve_dtype(requested: str, model_dtype: str | None, device: str) -> str:
    """requested: float32 | float16 | bfloat16 | auto -> the dtype name the engine runs in."""
    if requested != "auto":
        return requested
    wanted = model_dtype if model_dtype in NAMES.values() else "float32"
    if torch.device(device).type == "cpu" and wanted != "float32":
        if wanted == "float16" or not cpu_has_native_bf16():
            log.info("dtype auto: the model is %s but this CPU has no native %s; running in "
                     "float32", wanted, wanted)
            return "float32"
    return wanted
