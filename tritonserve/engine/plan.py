"""The decode plan: what this engine's steps run, decided once at load, with the reason for
each choice. Nothing else picks a path: the model runner builds what the plan names and
dispatches on it once a step, the start-up line and /version print it, and a bug report can
say which path ran.

Four choices, each with its reason:
- mode: how a decode-only step runs. layers: the whole decoder stack as one C++ op
  (kernels/cpu/decode_layers.cpp); compile: torch.compile graphs; cudagraph /
  compile+cudagraph: CUDA graphs per batch bucket; static: static buffers op by op (a test
  fixture, not on the command line); eager: op by op. Prefill steps always run eager.
- weights: the CPU projection weights' form (engine/models/linear.py). gguf: a GGUF file's
  quantized blocks as they are; compressed-tensors: a W4A16 / W8A16 checkpoint's codes
  (engine/models/compressed.py); int4 (-g64, -g128) / int8: quantized at load (all the C++
  quantized panels, kernels/quant_layout.py; any dense projection left in panels);
  panels: the C++ panel kernels (fp32, bf16); onednn: oneDNN's blocked layout; plain: [N, K]
  for F.linear.
- attention: triton (CUDA), cpu (the C++ paged attention reading the cache in place), torch
  (gather + SDPA).
- draw: the sampler's draw for rows with no top-k/p, min-p: triton (the kernel), cpu (the
  C++ softmax draw), torch. Rows that filter go through the torch path under every plan
  (engine/sampler.py says why on CUDA).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tritonserve.kernels import cpu

from .config import EngineConfig
from .models import ModelArch
from .models.compressed import Scheme
from .models.linear import PANEL_DTYPES, onednn_runs

ONEDNN_UNTRACEABLE = ("compile", "compile+cudagraph")  # oneDNN's packed tensor is opaque

# What auto runs on the CPU, by dtype. The layer stack in one op against the compiled graph on
# a 2-core AVX512-BF16 EPYC, one process, steps alternated: bf16 9.86 vs 10.37 ms at batch 1,
# 15.4 vs 16.8 at 16, 39.9 vs 41.6 at 64; fp32 14.4 vs 14.9, 36.9 vs 38.0, 143.8 vs 153.7; and
# nothing to compile (docs/perf-log/2026-cpu-decode.md). fp16 has no panels: eager.
CPU_DECODE_MODES = {"float32": "layers", "bfloat16": "layers"}
# What auto runs where layers does not take the model (q/k norms; in bf16 a head size without
# an instance, or a build without AVX512-BF16). fp32 SmolLM2 on a 2-core AVX2 EPYC, compiled
# vs eager: 40 vs 46 ms a step at batch 1, 116 vs 125 at 16, 306 vs 370 at 64, for ~145 s of
# compiling at the first start and ~30 s from the cache.
LAYERS_FALLBACK = "compile"
# --quantization auto serves a GGUF model's own blocks (the embedded SmolLM2 is one): on a
# 2-core AVX512-BF16 Zen 4, LLM.generate with 64 tokens a sequence, blocks (bf16 panels past
# DENSE_ABOVE rows) vs the bf16 conversion: 180 vs 80 tok/s at batch 1, 840 vs 832 at 16,
# 1209-1221 vs 1180-1206 at 64; served side by side: docs/benchmarks.md.
GGUF_BY_DEFAULT = True
# A GGUF model's blocks in bf16 serve steps of up to this many rows; larger ones run the bf16
# panels of its conversion, kept beside them (+2 bytes a weight: SmolLM2 +270 MB): the
# quantized tile scales each group of 32 k apart, ~1.2-1.3x the dense panels' work once a step
# is compute-bound. SmolLM2 through decode_layers, 64 tokens a sequence, blocks vs panels:
# 4 rows 480 vs 306 tok/s, 8 rows 692 vs 594, 12 rows 625 vs 727 (past 8 rows, one register
# tile, the blocks are widened into scratch first).
DENSE_ABOVE = 8


@dataclass(frozen=True)
class DecodePlan:
    mode: str
    weights: str
    attention: str
    draw: str
    why_mode: str
    why_weights: str
    # quantized weights with dense panels kept beside them: steps of more rows than this run
    # the dense ones (0: the weights' form runs every step)
    dense_above: int = 0

    @property
    def quantized(self) -> bool:
        """The weights are packed codes (gguf, compressed-tensors, int4/int8), not dense."""
        return self.weights not in ("plain", "panels", "onednn")

    def describe(self) -> str:
        """One phrase for the start-up line."""
        weights = self.weights + (f" (steps of up to {self.dense_above} rows; bf16 panels "
                                  f"above)" if self.dense_above else "")
        return (f"decode {self.mode} ({self.why_mode}), weights {weights}, attention "
                f"{self.attention}, draw {self.draw}")

    def as_dict(self) -> dict[str, str | int]:
        return asdict(self)


def resolve_plan(config: EngineConfig, arch: ModelArch, gguf: Path | None = None,
                 scheme: Scheme | None = None) -> DecodePlan:
    """The plan for this config (dtype already resolved) and model (gguf: the GGUF file it
    was converted from, or None; scheme: a compressed-tensors checkpoint's, or None). Raises
    ValueError where the config names a path that cannot take the model (decode_mode layers
    on Qwen3, quantization gguf on a folder)."""
    device = torch.device(config.device).type
    library = device == "cpu" and cpu.load()
    mode, why_mode = _mode(config, arch, device, library)
    weights, why_weights = _weights(config, device, library, mode, gguf, scheme)
    attention = ("triton" if config.use_triton("attention")
                 else "cpu" if library else "torch")
    draw = "triton" if config.use_triton("sampler") else "cpu" if library else "torch"
    dense_above = (DENSE_ABOVE if weights in ("gguf", "compressed-tensors")
                   and config.dtype == "bfloat16" and device == "cpu" else 0)
    return DecodePlan(mode, weights, attention, draw, why_mode, why_weights, dense_above)


def layers_refusal(config: EngineConfig, arch: ModelArch, library: bool) -> str | None:
    """Why decode_layers cannot run this model in this dtype, or None when it can: it needs
    the C++ library, the panels of the dtype, no q/k norms, an attention instance for the
    head shapes, and in bf16 the gate/up epilogue (intermediate size a multiple of 16)."""
    if not library:
        return "no C++ CPU library"
    group = arch.num_heads // arch.num_kv_heads
    what = f"{arch.architecture} in {config.dtype}"
    if config.torch_dtype not in PANEL_DTYPES:
        return f"{what}: no panels in {config.dtype}"
    if arch.qk_norm:
        return f"{what}: q/k norms"
    if config.dtype == "bfloat16" and arch.intermediate_size % 16:
        return f"{what}: intermediate size {arch.intermediate_size} not a multiple of 16"
    if cpu.decode_layers(config.torch_dtype, arch.head_dim, group,
                             config.cache.block_size) is None:
        return (f"{what}: no instance for head size {arch.head_dim}, {group} query heads a "
                f"KV head, block size {config.cache.block_size} in this build "
                f"({cpu.describe()})")
    return None


def _mode(config: EngineConfig, arch: ModelArch, device: str,
          library: bool) -> tuple[str, str]:
    asked = config.decode_mode
    tp = config.tensor_parallel_size
    if tp > 1:  # engine/parallel.py: an all-reduce after o and after down
        if asked not in ("auto", "eager"):
            raise ValueError(f"decode_mode {asked!r} with tensor_parallel_size {tp}: the "
                             f"layers op and the graphs take no all-reduce; tp runs eager")
        return "eager", f"tensor_parallel_size {tp}: the layers op takes no all-reduce"
    if asked == "layers":
        refusal = layers_refusal(config, arch, library)
        if refusal is not None:
            raise ValueError(f"decode_mode 'layers' does not take {refusal}; it needs "
                             f"float32, or bfloat16 on a CPU with AVX512-BF16 with head size "
                             f"64 or 128, at most 8 query heads a KV head, a block size that "
                             f"is a multiple of 16, and no q/k norms")
        return "layers", "asked"
    if asked != "auto":
        return asked, "asked"
    if device == "cuda" and config.use_triton("attention"):
        return "cudagraph", "auto on CUDA"
    if device != "cpu" or config.use_triton("attention"):
        return "eager", f"auto on {device} with the {config.attention_backend} attention"
    shipped = CPU_DECODE_MODES.get(config.dtype, "eager")
    if shipped != "layers":
        return shipped, f"auto on the CPU in {config.dtype}"
    refusal = layers_refusal(config, arch, library)
    if refusal is None:
        return "layers", f"auto on the CPU in {config.dtype}"
    return LAYERS_FALLBACK, f"auto; layers does not take {refusal}"


def _quantized(config: EngineConfig, device: str, library: bool, gguf: Path | None,
               scheme: Scheme | None) -> tuple[str, str] | None:
    """The quantized weights form and why, or None for dense weights (a compressed
    checkpoint's dequantized where its codes do not run)."""
    asked = config.quantization
    tp = config.tensor_parallel_size
    if tp > 1 and asked not in ("auto", "none"):
        raise ValueError(f"quantization {asked!r} with tensor_parallel_size {tp}: quantized "
                         f"weights are not split by rank yet; use none")
    on_cpu = device == "cpu" and library and config.torch_dtype in PANEL_DTYPES and tp == 1
    # CUDA runs the Triton w4a16 / w8a16 matmul when asked; auto keeps the dense weights
    # there until bench/gpu_check.sh has measured it on a GPU
    runs = on_cpu or (device == "cuda" and tp == 1)
    if asked == "auto" and scheme is not None and on_cpu:
        return "compressed-tensors", f"auto: the checkpoint's {scheme.describe()}"
    if asked == "none" or (asked == "auto" and not (GGUF_BY_DEFAULT and gguf and on_cpu)):
        return None
    if asked == "auto":
        return "gguf", f"auto: {gguf.name}'s own blocks"
    if asked == "gguf" and gguf is None:
        raise ValueError(f"quantization 'gguf' needs a GGUF model (--model FILE.gguf, or the "
                         f"embedded default); {config.model} is a checkpoint folder")
    if asked == "compressed-tensors" and scheme is None:
        raise ValueError(f"quantization 'compressed-tensors' needs a checkpoint whose "
                         f"config.json has a compressed-tensors quantization_config; "
                         f"{config.model} has none")
    if not runs:
        raise ValueError(f"quantization {asked!r} runs on CUDA (Triton), or on the CPU with "
                         f"the C++ library in float32 or bfloat16; here: {device}, "
                         f"{config.dtype}, library {'loaded' if library else 'unavailable'}")
    if asked == "gguf":
        return "gguf", f"{gguf.name}'s own blocks"
    if asked == "compressed-tensors":
        return asked, f"the checkpoint's {scheme.describe()}"
    if asked.startswith("int4"):
        group = asked.partition("-g")[2] or "32"
        return asked, f"quantized at load: groups of {group}, scale and offset"
    return asked, "quantized at load: per channel, symmetric"


def _weights(config: EngineConfig, device: str, library: bool, mode: str,
             gguf: Path | None, scheme: Scheme | None) -> tuple[str, str]:
    quantized = _quantized(config, device, library, gguf, scheme)
    if quantized is not None:
        return quantized
    if device != "cpu":
        return "plain", f"on {device}"
    if library and config.torch_dtype in PANEL_DTYPES:
        return "panels", f"C++ panels in {config.dtype}"
    if not onednn_runs(config.torch_dtype):
        return "plain", f"oneDNN does not run {config.dtype} here"
    if mode in ONEDNN_UNTRACEABLE:
        return "plain", "torch.compile cannot trace oneDNN's packed weights"
    return "onednn", "oneDNN's blocked layout (no C++ panels)"
