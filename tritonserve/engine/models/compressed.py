"""compressed-tensors checkpoints (llm-compressor's output; what vLLM loads as W4A16 / W8A16):
the weight-only integer formats read into the packed quantized layout
(kernels/quant_layout.py), plus their dequantized weights for the dense paths.

Served: `quantization_config.quant_method == "compressed-tensors"`, format `pack-quantized`
(int4 or int8 codes packed low bits first into int32 words along the row, stored as code +
2^(bits-1)) or `naive-quantized` (int8 codes as an int8 `weight`); strategy `group` (group_size
a multiple of 32) or `channel`; int4 symmetric or with zero points (packed along the output
dim), int8 symmetric. Weight = scale * (q - zero_point), as compressed_tensors' `dequantize`.
In the packed layout (u4: weight = d * code + m, code in 0..15; s8: d * q) each group of 32 k
gets its group's scale: d = scale, m = -scale * (8 + zero_point). d and m are stored in fp16:
exact for bf16 or fp16 scales in fp16's normal range and symmetric codes (m = -8 d); with zero
points m is rounded to fp16 once. Anything else (activation quantization, act-order g_idx, fp8,
more than one config group, asymmetric int8) is refused naming the field.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from tritonserve.kernels import quant_layout

from .gguf import QuantTensor

FORMATS = ("pack-quantized", "naive-quantized")
PARTS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")


class CompressedError(ValueError):
    pass


@dataclass(frozen=True)
class Scheme:
    """The weight quantization a compressed-tensors checkpoint declares."""

    format: str
    num_bits: int
    strategy: str  # group | channel
    group_size: int  # 0 for channel
    symmetric: bool
    ignore: tuple[str, ...]

    def describe(self) -> str:
        groups = (f"groups of {self.group_size}" if self.strategy == "group"
                  else "per channel")
        return (f"compressed-tensors W{self.num_bits}A16 {groups}, "
                f"{'symmetric' if self.symmetric else 'zero points'}")


def scheme_of(folder: str | Path | None) -> Scheme | None:
    """The folder's compressed-tensors scheme, None for a dense checkpoint (or no folder).
    Raises CompressedError naming the field for a scheme not served."""
    if folder is None or not (Path(folder) / "config.json").exists():
        return None
    config = json.loads((Path(folder) / "config.json").read_text())
    q = config.get("quantization_config")
    if not q or q.get("quant_method") != "compressed-tensors":
        return None
    fmt = q.get("format")
    where = f"{Path(folder).name}: quantization_config"
    if fmt not in FORMATS:
        raise CompressedError(f"{where}.format is {fmt!r}; served: {', '.join(FORMATS)}")
    groups = q.get("config_groups") or {}
    if len(groups) != 1:
        raise CompressedError(f"{where}.config_groups has {len(groups)} groups; one is served")
    name, group = next(iter(groups.items()))
    if group.get("input_activations"):
        raise CompressedError(f"{where}.config_groups.{name}.input_activations: activation "
                              f"quantization is not served (weight-only W4A16 / W8A16 are)")
    w = group.get("weights") or {}
    bits, kind = w.get("num_bits"), w.get("type", "int")
    if kind != "int" or bits not in (4, 8):
        raise CompressedError(f"{where}.config_groups.{name}.weights: {kind} {bits}-bit; "
                              f"served: int 4 or 8")
    strategy, size = w.get("strategy"), w.get("group_size") or 0
    if strategy not in ("group", "channel") or (strategy == "group" and size % 32):
        raise CompressedError(f"{where}.config_groups.{name}.weights.strategy {strategy!r} "
                              f"(group_size {size}); served: channel, or group with "
                              f"group_size a multiple of 32")
    if w.get("actorder") not in (None, "static"):
        raise CompressedError(f"{where}.config_groups.{name}.weights.actorder "
                              f"{w.get('actorder')!r}: act-order groups are not served")
    symmetric = bool(w.get("symmetric", True))
    if bits == 8 and not symmetric:
        raise CompressedError(f"{where}.config_groups.{name}.weights.symmetric: int8 with "
                              f"zero points is not served")
    if fmt == "naive-quantized" and bits != 8:
        raise CompressedError(f"{where}.format naive-quantized is served for int8 only")
    return Scheme(fmt, bits, strategy, size if strategy == "group" else 0, symmetric,
                  tuple(q.get("ignore") or ()))


def _unpack_codes(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """int32 words [R, W] -> unsigned codes [R, count] (element i at bits i * bits, little-
    endian words: for 4 and 8 bits a byte's low bits first)."""
    raw = words.contiguous().view(torch.uint8).to(torch.int16)
    if bits == 4:
        raw = torch.stack((raw & 15, raw >> 4), dim=-1).reshape(words.shape[0], -1)
    return raw[:, :count]


def read_compressed(folder: str | Path, scheme: Scheme
                    ) -> tuple[dict[str, torch.Tensor], dict[str, QuantTensor]]:
    """(dense, packed) by Hugging Face weight name: every quantized projection dequantized in
    fp32 (for the loader: engine/models/loader.py's `substitute`) and packed. Dense tensors of
    the checkpoint are left to the loader."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    folder = Path(folder)
    from .loader import open_safetensors, safetensors_files  # the loader imports this module

    for path in safetensors_files(folder):
        with open_safetensors(path) as f:
            for key in f.keys():
                prefix, _, part = key.rpartition(".")
                if part in PARTS or (scheme.format == "naive-quantized" and part == "weight"
                                     and f.get_slice(key).get_dtype() == "I8"):
                    parts.setdefault(prefix, {})[part] = f.get_tensor(key)
    dense: dict[str, torch.Tensor] = {}
    packed: dict[str, QuantTensor] = {}
    for prefix, p in parts.items():
        if "weight_g_idx" in p:
            raise CompressedError(f"{prefix}.weight_g_idx: act-order groups are not served")
        if "weight_scale" not in p:
            continue  # a dense tensor named like a part
        scale = p["weight_scale"].float()
        if scheme.format == "pack-quantized":
            n, k = (int(s) for s in p["weight_shape"])
            q = _unpack_codes(p["weight_packed"], scheme.num_bits, k) - (1 << scheme.num_bits - 1)
        else:
            q = p["weight"].to(torch.int16)
            n, k = q.shape
        if k % quant_layout.GROUP:
            raise CompressedError(f"{prefix}: row length {k} is not a multiple of "
                                  f"{quant_layout.GROUP}")
        per = scheme.group_size or k  # k a scale covers
        zp = torch.zeros_like(scale)
        if "weight_zero_point" in p:
            zp = (_unpack_codes(p["weight_zero_point"].t(), scheme.num_bits, n).t()
                  - (1 << scheme.num_bits - 1)).float()
        expected = (n, k // per)
        if tuple(scale.shape) != expected or tuple(zp.shape) != expected:
            raise CompressedError(f"{prefix}: weight_scale {tuple(scale.shape)}, expected "
                                  f"{expected} for {scheme.describe()}")
        name = f"{prefix}.weight"
        wide = per // quant_layout.GROUP  # records of 32 k a scale covers
        d = scale.repeat_interleave(wide, dim=1)
        if scheme.num_bits == 4:
            m = (-scale * (8 + zp)).repeat_interleave(wide, dim=1)
            weight = quant_layout.pack("u4", d, q + 8, m)
        else:
            weight = quant_layout.pack("s8", d, q)
        packed[name] = QuantTensor(f"W{scheme.num_bits}A16", weight_kind(scheme), weight, (n, k))
        dense[name] = (q.float() - zp.repeat_interleave(per, dim=1)) * \
            scale.repeat_interleave(per, dim=1)
    return dense, packed


def weight_kind(scheme: Scheme) -> str:
    return "u4" if scheme.num_bits == 4 else "s8"
