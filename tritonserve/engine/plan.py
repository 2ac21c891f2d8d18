"""The decode plan: what this engine's steps run, decided once at load, with the reason for
each choice. Nothing else picks a path: the model runner builds what the plan names and
dispatches on it once a step, the start-up line and /version print it, and a bug report can
say which path ran.

Four choices, each with its reason (and for a mixture of experts, where its experts run):
- mode: how a decode-only step runs. layers: the whole decoder stack as one C++ op
  (kernels/cpu/decode_layers.cpp); compile: torch.compile graphs; cudagraph /
  compile+cudagraph: CUDA graphs per batch bucket; static: static buffers op by op (a test
  fixture, not on the command line); eager: op by op. Prefill steps always run eager.
- weights: the projections' form, chosen in engine/weights.py (which also owns the dense
  twin above `dense_above` rows and the row cap `max_rows`): gguf, compressed-tensors, int4 /
  int8 quantized at load, or dense panels / onednn / plain.
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

from . import weights
from .config import EngineConfig
from .models import ModelArch
from .models.compressed import Scheme
from .models.linear import PANEL_DTYPES


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


@dataclass(frozen=True)
class DecodePlan:
    mode: str
    weights: str
    attention: str
    draw: str
    why_mode: str
    why_weights: str
    # quantized weights with dense panels kept beside them: steps of more rows than this run
    # the dense ones (0: the weights' form runs every step); engine/weights.py
    dense_above: int = 0
    # decode rows a speculating step may reach (the scheduler's cap): weights.row_cap
    max_rows: int = weights.ANY_ROWS
    # a mixture of experts' experts (engine/models/moe.py: MoeExperts picks by device alike):
    # cpu (kernels/cpu/moe.cpp: rows grouped by expert, only the chosen experts read),
    # triton (kernels/triton/fused_moe.py), torch (a matmul pair an expert); "" for a dense MLP
    experts: str = ""

    @property
    def quantized(self) -> bool:
        """The weights are packed codes (gguf, compressed-tensors, int4/int8), not dense."""
        return self.weights not in weights.DENSE_FORMS

    def describe(self) -> str:
        """One phrase for the start-up line."""
        weights = self.weights + (f" (steps of up to {self.dense_above} rows; bf16 panels "
                                  f"above)" if self.dense_above else "")
        experts = f", experts {self.experts}" if self.experts else ""
        return (f"decode {self.mode} ({self.why_mode}), weights {weights}, attention "
                f"{self.attention}{experts}, draw {self.draw}")

    def as_dict(self) -> dict[str, str | int]:
        """What /version shows: the choices and their reasons (max_rows, the scheduler's
        cap, follows from them)."""
        shown = asdict(self)
        del shown["max_rows"]
        if not self.experts:  # a dense model has no experts' path
            del shown["experts"]
        return shown


def resolve_plan(config: EngineConfig, arch: ModelArch, gguf: Path | None = None,
                 scheme: Scheme | None = None) -> DecodePlan:
    """The plan for this config (dtype already resolved) and model (gguf: the GGUF file it
    was converted from, or None; scheme: a compressed-tensors checkpoint's, or None). Raises
    ValueError where the config names a path that cannot take the model (decode_mode layers
    on Qwen3, quantization gguf on a folder)."""
    device = torch.device(config.device).type
    library = device == "cpu" and cpu.load()
    mode, why_mode = _mode(config, arch, device, library)
    form, why_weights = weights.choose(config, device, library, mode, gguf, scheme)
    attention = ("triton" if config.use_triton("attention")
                 else "cpu" if library else "torch")
    draw = "triton" if config.use_triton("sampler") else "cpu" if library else "torch"
    twin_above = weights.dense_above(form, config, device, arch)
    experts = ("" if arch.variant.experts is None else "triton" if device == "cuda"
               else "cpu" if library else "torch")
    return DecodePlan(mode, form, attention, draw, why_mode, why_weights, twin_above,
                      weights.row_cap(form, config, twin_above), experts)


def layers_refusal(config: EngineConfig, arch: ModelArch, library: bool) -> str | None:
    """Why decode_layers cannot run this model in this dtype, or None when it can: it needs
    the C++ library, the panels of the dtype, Llama's layer (no q/k norms, pre-norms, silu:
    DecoderVariant.layers_op_refusal), an attention instance for the
    head shapes, and in bf16 the gate/up epilogue (intermediate size a multiple of 16)."""
    if not library:
        return "no C++ CPU library"
    group = arch.num_heads // arch.num_kv_heads
    what = f"{arch.architecture} in {config.dtype}"
    if config.torch_dtype not in PANEL_DTYPES:
        return f"{what}: no panels in {config.dtype}"
    differs = arch.variant.layers_op_refusal() or masked_attention(arch)
    if differs is not None:
        return f"{what}: {differs}"
    if config.dtype == "bfloat16" and arch.intermediate_size % 16:
        return f"{what}: intermediate size {arch.intermediate_size} not a multiple of 16"
    if cpu.decode_layers(config.torch_dtype, arch.head_dim, group,
                             config.cache.block_size) is None:
        return (f"{what}: no instance for head size {arch.head_dim}, {group} query heads a "
                f"KV head, block size {config.cache.block_size} in this build "
                f"({cpu.describe()})")
    return None


def masked_attention(arch: ModelArch) -> str | None:
    """What in the model's attention the layers op, CUDA graphs and the compiled graphs over
    torch's attention do not take (a window shorter than the model's context, a score
    soft-cap: engine/attention.py's masked path runs those), or None."""
    window = arch.sliding_window
    reasons = [r for r, odd in (
        (f"sliding windows of {window}", window is not None
         and window < arch.max_position_embeddings),
        ("an attention soft-cap", arch.variant.attn_softcap is not None),
        ("attention sinks", arch.variant.sinks)) if odd]
    return ", ".join(reasons) or None


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
                             f"is a multiple of 16, and Llama's layer (no q/k norms)")
        return "layers", "asked"
    if asked != "auto":
        return asked, "asked"
    masked = masked_attention(arch)
    if device == "cuda" and config.use_triton("attention"):
        if masked is not None:
            return "eager", f"auto on CUDA; the graphs do not take {masked}"
        return "cudagraph", "auto on CUDA"
    if device != "cpu" or config.use_triton("attention"):
        return "eager", f"auto on {device} with the {config.attention_backend} attention"
    shipped = CPU_DECODE_MODES.get(config.dtype, "eager")
    if shipped != "layers":
        return shipped, f"auto on the CPU in {config.dtype}"
    refusal = layers_refusal(config, arch, library)
    if refusal is None:
        return "layers", f"auto on the CPU in {config.dtype}"
    if arch.variant.experts is not None and not library:  # torch's experts loop reads
        return "eager", "auto; without the C++ library the experts run op by op"  # counts
    if masked is not None and not library:  # torch's masked path reads lengths on the host
        return "eager", f"auto; layers and compile without the C++ library do not take {masked}"
    # the compiled graph calls the C++ decode op, which takes windows and soft-caps itself
    return LAYERS_FALLBACK, f"auto; layers does not take {refusal}"
