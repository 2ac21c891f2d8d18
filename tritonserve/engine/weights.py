"""Weight forms in one place: which form a model's projections take and why (the decode
plan's `weights`), the dense twin kept beside quantized weights for large steps and the rows
a step may hold (both plan fields), and how a built model is put in its form.

The forms (engine/models/linear.py packs and runs each; kernels/quant_layout.py's KINDS names
the quantized codes):
- gguf: a GGUF file's blocks as they are (engine/models/gguf.py);
- compressed-tensors: a W4A16 / W8A16 checkpoint's codes (engine/models/compressed.py);
- int4, int4-g64, int4-g128, int8: quantized at load (QUANTIZED_AT_LOAD);
- panels: the C++ panel kernels (fp32, bf16); onednn: oneDNN's blocked layout; plain: [N, K]
  for F.linear.
A quantized form leaves any projection it cannot take (a row length off the group) in the
best dense form here, and the embedding table dense for the lookup.
"""
from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import EngineConfig
from .models import DecoderForCausalLM, ModelArch
from .models.compressed import Scheme
from .models.gguf import read_quantized_cached, types_of
from .models.linear import PANEL_DTYPES, has_form, onednn_runs
from .speculative import BF16_INVARIANT_ROWS

log = logging.getLogger("tritonserve.engine")

DENSE_FORMS = ("plain", "panels", "onednn")
# the forms quantized at load -> the packed kind and group (kernels/quant_layout.py)
QUANTIZED_AT_LOAD = {"int4": ("u4", 32), "int4-g64": ("u4", 64), "int4-g128": ("u4", 128),
                     "int8": ("s8", 32)}
ONEDNN_UNTRACEABLE = ("compile", "compile+cudagraph")  # oneDNN's packed tensor is opaque
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
ANY_ROWS = 1 << 30


def choose(config: EngineConfig, device: str, library: bool, mode: str, gguf: Path | None,
           scheme: Scheme | None) -> tuple[str, str]:
    """The projections' form and why. Raises ValueError where the config names a form that
    cannot take the model or run here."""
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


def dense_above(form: str, config: EngineConfig, device: str, arch: ModelArch) -> int:
    """Rows past which a step runs the dense twin (0: no twin, the form runs every step).
    None for a mixture of experts: a dense copy of every expert is the memory the blocks
    saved (a step's rows spread over the experts, each taking few of them)."""
    return (DENSE_ABOVE if form in ("gguf", "compressed-tensors")
            and config.dtype == "bfloat16" and device == "cpu"
            and arch.variant.experts is None else 0)


def row_cap(form: str, config: EngineConfig, twin_above: int) -> int:
    """Decode rows a speculating step may reach (the scheduler's max_rows): within the
    twin's threshold (past it other weights would run than the same step without
    proposals), and on bf16 quantized weights within the rows whose sums do not depend on
    their company (speculative.BF16_INVARIANT_ROWS), so greedy output is one row's."""
    rows = twin_above or ANY_ROWS
    if config.torch_dtype == torch.bfloat16 and form not in DENSE_FORMS:
        rows = min(rows, BF16_INVARIANT_ROWS)
    return rows


def _quantized(config: EngineConfig, device: str, library: bool, gguf: Path | None,
               scheme: Scheme | None) -> tuple[str, str] | None:
    """The quantized form and why, or None for dense weights (a compressed checkpoint's
    dequantized where its codes do not run)."""
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


@dataclass
class Weights:
    """The model in its form, and the dense twin a step of more than `dense_above` rows
    runs instead (None: the model runs every step)."""

    model: DecoderForCausalLM
    dense: DecoderForCausalLM | None = None
    dense_above: int = 0

    def model_for(self, rows: int) -> DecoderForCausalLM:
        """The model whose weights a step of `rows` rows runs."""
        if self.dense is not None and rows > self.dense_above:
            return self.dense
        return self.model


def put_in_form(model: DecoderForCausalLM, form: str, twin_above: int, config: EngineConfig,
                arch: ModelArch, gguf: Path | None, folder: Path | None,
                packed: dict | None, scheme: Scheme | None) -> Weights:
    """The built (dense, loaded) model's projections in `form`, with the dense twin where
    `twin_above` asks for one; packed: a compressed checkpoint's codes."""
    batch_hint = config.scheduler.max_num_seqs
    dense = None
    if twin_above:  # copied before the quantized weights replace the projections, sharing
        table = model.embed_tokens  # the embedding table
        dense = copy.deepcopy(model, memo={id(table): table})
        dense.prepack_weights("panels", batch_hint, fuse_silu=not config.serves_lora)
        dense.gather_streamed_weights()
    if form == "gguf":
        # auto: a tensor with no block form is served dense; asked by name, refused
        tensors = read_quantized_cached(gguf, arch.num_heads, arch.num_kv_heads, folder,
                                        strict=config.quantization == "gguf",
                                        family=arch.family)
        model.load_quantized(tensors)
        log.info("quantized weights from %s: %s", gguf.name, types_of(tensors))
    elif form == "compressed-tensors":
        model.load_quantized(packed)
        log.info("quantized weights from %s: %s", scheme.describe(), types_of(packed))
    elif form in QUANTIZED_AT_LOAD:
        model.quantize_weights(*QUANTIZED_AT_LOAD[form])
    if form not in DENSE_FORMS:  # the projections left dense
        form = "panels" if has_form("panels", config.torch_dtype) else "plain"
    model.prepack_weights(form, batch_hint=batch_hint, fuse_silu=not config.serves_lora)
    if model.embed_tokens.weight.device.type == "cpu":
        model.gather_streamed_weights()
    return Weights(model, dense, twin_above)
