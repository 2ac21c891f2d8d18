"""A GGUF file's quantized projection weights as they are: each tensor's blocks parsed into
(d, integer codes, m) and packed for the quantized matmul (kernels/quant_layout.py), named as
the Hugging Face checkpoint names them. Config, tokenizer and the small tensors (norms, the
embedding table for the lookup) come from the converted folder (engine/default_model.py).

Served as blocks: Q8_0 (s8), Q4_0 and Q4_1 (u4). K-quants (Q4_K, Q6_K, ...) use 256-wide super
blocks, which SmolLM2's 576-wide rows are not a multiple of (llama.cpp's own quantizer falls
back to Q5_0 / Q8_0 for such tensors); a file with them, or any other type, is refused with
its name (`--quantization none` serves the dequantized conversion instead).
The q and k projections are stored permuted for llama.cpp's interleaved rope; their rows are
put back as transformers' GGUF loader does (LlamaTensorProcessor._reverse_permute_weights).
Parsing and packing the embedded file takes ~3 s, every engine start: `read_quantized_cached`
keeps the packed panels in the converted folder (PACKED, keyed by the file's size and mtime
and the layout's PACKED_VERSION) and maps them back in a fraction of that.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tritonserve.kernels import quant_layout

# GGML block types served as they are: (kind, block bytes)
SERVED = {"Q8_0": ("s8", 34), "Q4_0": ("u4", 18), "Q4_1": ("u4", 20)}
DENSE = ("F32", "F16", "BF16")  # norms, biases: read through the converted folder

_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


class GGUFError(ValueError):
    pass


@dataclass(frozen=True)
class QuantTensor:
    """One weight [N, K]: its source type (a GGML type, or a compressed-tensors scheme's
    W4A16 / W8A16), the packing kind and the packed panels."""

    type_name: str
    kind: str
    packed: torch.Tensor
    shape: tuple[int, int]


def hf_name(name: str) -> str | None:
    """A GGUF tensor name -> the Hugging Face one (None: not a projection or embedding)."""
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output.weight":
        return "lm_head.weight"
    found = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
    if found and found.group(2) in _NAMES:
        return f"model.layers.{found.group(1)}.{_NAMES[found.group(2)]}.weight"
    return None


def parse_blocks(ggml_type: str, raw: np.ndarray, n: int, k: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """raw uint8 [N, bytes a row] of one of SERVED -> (d [N, G] fp32, q [N, K] int16,
    m [N, G] fp32 or None), weight = d * q + m per block of 32."""
    kind, size = SERVED[ggml_type]
    groups = k // quant_layout.GROUP
    blocks = np.ascontiguousarray(raw).reshape(n, groups, size)
    d = torch.from_numpy(blocks[:, :, 0:2].copy().view(np.float16)[..., 0]).float()
    if kind == "s8":
        q = torch.from_numpy(blocks[:, :, 2:].copy().view(np.int8)).to(torch.int16)
        return d, q.reshape(n, k), None
    start = 4 if ggml_type == "Q4_1" else 2
    nib = torch.from_numpy(blocks[:, :, start:].copy()).to(torch.int16)  # [N, G, 16]
    q = torch.cat((nib & 15, nib >> 4), dim=2).reshape(n, k)  # elements 0-15, then 16-31
    if ggml_type == "Q4_1":
        m = torch.from_numpy(blocks[:, :, 2:4].copy().view(np.float16)[..., 0]).float()
        return d, q, m
    return d, q, -8 * d  # Q4_0: d * (q - 8)


def unpermute_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q or k projection back from llama.cpp's rope order."""
    dim = t.shape[0] // heads // 2
    return t.reshape(heads, dim, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def read_quantized(path: str | Path, num_heads: int, num_kv_heads: int
                   ) -> dict[str, QuantTensor]:
    """Every quantized projection and embedding of the file by its Hugging Face name, packed.
    Raises GGUFError naming the tensor and type where a tensor is in a type not served."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    out: dict[str, QuantTensor] = {}
    for tensor in reader.tensors:
        type_name = tensor.tensor_type.name
        name = hf_name(tensor.name)
        if type_name in DENSE or name is None:
            continue
        if type_name not in SERVED:
            raise GGUFError(f"{Path(path).name}: tensor {tensor.name} is {type_name}; the "
                            f"quantized weights serve {', '.join(SERVED)} as they are "
                            f"(--quantization none serves the file dequantized)")
        k, n = (int(s) for s in tensor.shape)  # GGUF lists the row length first
        d, q, m = parse_blocks(type_name, tensor.data, n, k)
        heads = num_heads if ".attn_q." in tensor.name else num_kv_heads
        if ".attn_q." in tensor.name or ".attn_k." in tensor.name:
            d, q = unpermute_rows(d, heads), unpermute_rows(q, heads)
            m = None if m is None else unpermute_rows(m, heads)
        kind = SERVED[type_name][0]
        out[name] = QuantTensor(type_name, kind, quant_layout.pack(kind, d, q, m), (n, k))
    return out


# safetensors inside, not named *.safetensors: the loader reads every such file of the folder
PACKED = "gguf-blocks.packed"
PACKED_VERSION = "1"  # raise when quant_layout's bytes or parse_blocks' output change


def _file_key(path: Path) -> str:
    stat = path.stat()
    return f"{PACKED_VERSION}:{stat.st_size}:{stat.st_mtime_ns}"


def read_quantized_cached(path: str | Path, num_heads: int, num_kv_heads: int,
                          folder: Path | None) -> dict[str, QuantTensor]:
    """read_quantized, kept in `folder` (the file's converted folder; None: not kept): a later
    call for the same file (size, mtime) and layout version maps the packed panels back."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = Path(path)
    cached = folder / PACKED if folder is not None else None
    if cached is not None and cached.exists():
        with safe_open(str(cached), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("key") == _file_key(path):
                info = json.loads(meta["tensors"])
                return {name: QuantTensor(t, kind, f.get_tensor(name), tuple(shape))
                        for name, (t, kind, shape) in info.items()}
    tensors = read_quantized(path, num_heads, num_kv_heads)
    if cached is not None:
        tmp = None
        try:  # written beside, renamed into place: a reader never sees half a file
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=".packed-")
            os.close(fd)
            os.chmod(tmp, 0o644)  # as the folder's other files
            info = {n: (t.type_name, t.kind, list(t.shape)) for n, t in tensors.items()}
            save_file({n: t.packed for n, t in tensors.items()}, tmp,
                      metadata={"key": _file_key(path), "tensors": json.dumps(info)})
            os.replace(tmp, cached)
        except OSError:  # a read-only cache: parse each time
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
    return tensors


def fuse_rows(parts: list[QuantTensor]) -> torch.Tensor | None:
    """Packed weights stacked by rows (q, k, v into qkv; gate, up), or None where they differ
    in kind or a part's rows are not whole panels (their packing would need a repack)."""
    if len({p.kind for p in parts}) != 1:
        return None
    if any(p.shape[0] % quant_layout.COLS for p in parts[:-1]):
        return None
    return torch.cat([p.packed for p in parts], dim=0)


def types_of(tensors: dict[str, QuantTensor]) -> str:
    """The source types served, with how many tensors each: 'Q4_1 x210, Q8_0 x1'."""
    counts: dict[str, int] = {}
    for t in tensors.values():
        counts[t.type_name] = counts.get(t.type_name, 0) + 1
    return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))
