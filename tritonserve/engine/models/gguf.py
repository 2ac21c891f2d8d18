"""A GGUF file's quantized projection weights as they are: each tensor's blocks parsed into
(d, integer codes, m) and packed for the quantized matmul (kernels/quant_layout.py), named as
the Hugging Face checkpoint names them. Config, tokenizer and the small tensors (norms, the
embedding table for the lookup) come from the converted folder (engine/default_model.py).

Served as blocks: Q8_0 and Q5_0 (s8: Q5_0's 5-bit codes less 16 fit an int8, exactly), Q4_0,
Q4_1 and Q4_K (u4), Q6_K (s8h), Q5_1 and Q5_K (s8hm), MXFP4 (s8, exactly: MXFP4_VALUES). Q4_K's 256-wide super block holds eight
32-wide sub blocks of 4-bit codes, each with a 6-bit scale and min under the block's fp16 d
and dmin: a sub block becomes one group with d * scale and -dmin * min rounded to fp16, the
layout's (at most 2^-11 of the scale, against a 4-bit code's step of 1/15 of the range).
Q5_K is Q4_K with a fifth bit a code: s8hm keeps d and the 6-bit scale apart (exact) and
rounds -dmin * min to fp16 as Q4_K does. Q6_K's 16-wide sub blocks of 6-bit codes (less 32:
an int8) each have an int8 scale under the super block's fp16 d: s8h keeps d and both scales
of a 32-wide group as they are. The 5- and 6-bit codes are widened to bytes, as Q5_0's are
(9-9.5 bits a weight against the file's 5.5-6.56). Every type but Q4_K and Q5_K is exact.
The other types (Q2_K, Q3_K, the IQ types, ...) have no form in the layout: under
--quantization auto such a tensor is served from the converted folder's dequantized weights
(dense panels; the start-up line counts them), under --quantization gguf the file is refused
naming the tensor and type. The K types need rows that are a multiple of 256: SmolLM2's
576-wide rows are not, and llama.cpp's quantizer gives such tensors Q5_0 / Q8_0 in its K
mixes (a K type on such a row cannot be written at all). Projections fused into one matmul
(q, k, v; gate, up) whose parts came in different types (a K mix's Q6_K attn_v beside Q4_K q
and k) are repacked into s8hm, which holds every kind with its codes and scales as they were.
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
from typing import Mapping

import numpy as np
import torch

from tritonserve.kernels import quant_layout

from .family import FAMILIES, LLAMA_GGUF_NAMES

# GGML block types served as they are: (kind, block bytes, values a block)
SERVED = {"Q8_0": ("s8", 34, 32), "Q5_0": ("s8", 22, 32), "Q4_0": ("u4", 18, 32),
          "Q4_1": ("u4", 20, 32), "Q4_K": ("u4", 144, 256), "Q6_K": ("s8h", 210, 256),
          "Q5_1": ("s8hm", 24, 32), "Q5_K": ("s8hm", 176, 256), "MXFP4": ("s8", 17, 32)}
# MXFP4 (gpt-oss's experts): 32 e2m1 codes under one e8m0 exponent. Doubled, the codes are
# the integers below (gguf-py's MXFP4.kvalues) and the scale halved is a power of two, which
# fp16 holds exactly from 2^-24 to 2^15: served as s8 blocks, exact, at 8.5 bits a weight
# instead of the file's 4.25 (a native 4-bit kind for it is not built yet).
MXFP4_VALUES = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12],
                            dtype=torch.int16)
DENSE = ("F32", "F16", "BF16")  # norms, biases: read through the converted folder


class GGUFError(ValueError):
    pass


@dataclass(frozen=True)
class QuantTensor:
    """One weight [N, K]: its source type (a GGML type, or a compressed-tensors scheme's
    W4A16 / W8A16), the packing kind and the packed panels; stacked experts [E, N, K] are
    each expert's panels stacked (packed[e]), shape the one expert's."""

    type_name: str
    kind: str
    packed: torch.Tensor
    shape: tuple[int, int]


def hf_name(name: str, names: Mapping[str, str] = LLAMA_GGUF_NAMES) -> str | None:
    """A GGUF tensor name -> the Hugging Face one (None: not a projection or embedding);
    names: the family's block names (family.py: ModelFamily.gguf_names)."""
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output.weight":
        return "lm_head.weight"
    found = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
    if found and found.group(2) in names:
        return f"model.layers.{found.group(1)}.{names[found.group(2)]}.weight"
    return None


def _half(blocks: np.ndarray, at: int) -> torch.Tensor:
    """The fp16 at byte `at` of every block -> fp32 [N, blocks]."""
    return torch.from_numpy(blocks[:, :, at:at + 2].copy().view(np.float16)[..., 0]).float()


def _nibbles(packed: np.ndarray) -> torch.Tensor:
    """uint8 [..., B] -> int16 [..., 2B]: the B low nibbles, then the B high ones."""
    nib = torch.from_numpy(np.ascontiguousarray(packed)).to(torch.int16)
    return torch.cat((nib & 15, nib >> 4), dim=-1)


def _q4_k_scales(scales: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 bytes of 6-bit scales and mins -> (scale [..., 8], min [..., 8]) int:
    bytes 0-3 hold scales 0-3 (low 6 bits), 4-7 mins 0-3, 8-11 the low nibbles of scales 4-7
    and high nibbles of mins 4-7, whose top 2 bits are the top bits of bytes 0-3 / 4-7."""
    b = torch.from_numpy(np.ascontiguousarray(scales)).to(torch.int16)
    low, high, mixed = b[..., 0:4], b[..., 4:8], b[..., 8:12]
    scale = torch.cat((low & 63, (mixed & 15) | ((low >> 6) << 4)), dim=-1)
    minimum = torch.cat((high & 63, (mixed >> 4) | ((high >> 6) << 4)), dim=-1)
    return scale, minimum


def parse_blocks(ggml_type: str, raw: np.ndarray, n: int, k: int) -> tuple:
    """raw uint8 [N, bytes a row] of one of SERVED -> (d [N, G] fp32, q [N, K] int16,
    m [N, G] fp32 or None), weight = d * q + m per group of 32; Q6_K: (d [N, G], q, its int8
    sub-block scales [N, K / 16]), weight = (d * s) * q per 16 k (quant_layout's s8h); Q5_1
    and Q5_K: (d, q, m, sub) for s8hm, weight = (d * s) * q + m."""
    kind, size, values = SERVED[ggml_type]
    blocks = np.ascontiguousarray(raw).reshape(n, k // values, size)
    d = _half(blocks, 0)
    if ggml_type == "Q8_0":
        q = torch.from_numpy(blocks[:, :, 2:].copy().view(np.int8)).to(torch.int16)
        return d, q.reshape(n, k), None
    if ggml_type == "MXFP4":  # e8m0 exponent e: the doubled codes' scale is 2^(e - 128)
        e = torch.from_numpy(blocks[:, :, 0].astype(np.int32))
        d = torch.pow(2.0, (e - 128).double()).float()
        if float(d.max()) > 2.0 ** 15:
            raise GGUFError(f"an MXFP4 block's scale 2^{int(e.max()) - 128} is past fp16's "
                            f"range (s8 blocks hold at most 2^15)")
        return d, MXFP4_VALUES[_nibbles(blocks[:, :, 1:]).long()].reshape(n, k), None
    if ggml_type == "Q5_0":  # 4 bytes of fifth bits (bit j: value j), 16 of nibbles
        high = torch.from_numpy(blocks[:, :, 2:6].copy().view(np.uint32)[..., 0].astype(
            np.int64))
        fifth = (high.unsqueeze(-1) >> torch.arange(32)) & 1  # [N, G, 32]
        q = _nibbles(blocks[:, :, 6:]) + 16 * fifth - 16
        return d, q.to(torch.int16).reshape(n, k), None
    if ggml_type == "Q6_K":  # ql [128], qh [64], scales int8 [16], d at byte 208
        supers = k // values
        d = _half(blocks, 208).repeat_interleave(values // 32, dim=1)  # [N, G]
        low = torch.from_numpy(blocks[:, :, :128].copy()).to(torch.int16).view(n, supers, 2, 1, 64)
        low = (low >> torch.tensor([0, 4]).view(1, 1, 1, 2, 1)) & 15  # [N, S, 2, 2, 64]
        high = torch.from_numpy(blocks[:, :, 128:192].copy()).to(torch.int16).view(
            n, supers, 2, 1, 32)
        high = (high >> torch.tensor([0, 2, 4, 6]).view(1, 1, 1, 4, 1)) & 3  # [N, S, 2, 4, 32]
        q = (low.reshape(n, supers, 8, 32) | high.reshape(n, supers, 8, 32) << 4) - 32
        sub = torch.from_numpy(blocks[:, :, 192:208].copy().view(np.int8)).to(torch.int16)
        return d, q.reshape(n, k), sub.reshape(n, k // 16)
    if ggml_type == "Q5_1":  # d, m, 4 bytes of fifth bits (bit j: value j), 16 of nibbles
        high = torch.from_numpy(blocks[:, :, 4:8].copy().view(np.uint32)[..., 0].astype(
            np.int64))
        fifth = (high.unsqueeze(-1) >> torch.arange(32)) & 1  # [N, G, 32]
        q = _nibbles(blocks[:, :, 8:]) + 16 * fifth
        return (d, q.to(torch.int16).reshape(n, k), _half(blocks, 2),
                torch.ones(n, k // 16, dtype=torch.int16))
    if ggml_type == "Q5_K":  # d, dmin, 12 scale bytes, 32 of fifth bits, 4 x 32 of nibbles
        scale, minimum = _q4_k_scales(blocks[:, :, 4:16])  # [N, S, 8]
        fifth = torch.from_numpy(blocks[:, :, 16:48].copy()).to(torch.int16).view(
            n, -1, 1, 32) >> torch.arange(8, dtype=torch.int16).view(1, 1, 8, 1)
        low = _nibbles(blocks[:, :, 48:].reshape(n, -1, 4, 32)).view(n, -1, 8, 32)
        q = low | (fifth & 1) << 4  # [N, S, 8 sub blocks, 32]
        m_sub = -(_half(blocks, 2).unsqueeze(-1) * minimum).reshape(n, -1)  # [N, G]
        return (d.repeat_interleave(values // 32, dim=1), q.reshape(n, k), m_sub,
                scale.repeat_interleave(2, dim=-1).reshape(n, k // 16))
    if ggml_type == "Q4_K":  # d, dmin, 12 scale bytes, 4 x 32 bytes: sub blocks 2p, 2p + 1
        scale, minimum = _q4_k_scales(blocks[:, :, 4:16])  # [N, S, 8]
        d_sub = (d.unsqueeze(-1) * scale).reshape(n, -1)  # [N, G]: exact in fp32
        m_sub = -(_half(blocks, 2).unsqueeze(-1) * minimum).reshape(n, -1)
        codes = _nibbles(blocks[:, :, 16:].reshape(n, -1, 4, 32))  # [N, S, 4, 64]
        return d_sub, codes.reshape(n, k), m_sub
    q = _nibbles(blocks[:, :, 4 if ggml_type == "Q4_1" else 2:]).reshape(n, k)
    if ggml_type == "Q4_1":
        return d, q, _half(blocks, 2)
    return d, q, -8 * d  # Q4_0: d * (q - 8)


def pack_parsed(ggml_type: str, parsed: tuple) -> torch.Tensor:
    """parse_blocks' answer for a type -> its packed panels in the type's kind (SERVED)."""
    kind = SERVED[ggml_type][0]
    if kind == "s8h":
        d, q, sub = parsed
        return quant_layout.pack(kind, d, q, sub=sub)
    if kind == "s8hm":
        d, q, m, sub = parsed
        return quant_layout.pack(kind, d, q, m, sub=sub)
    return quant_layout.pack(kind, *parsed)


def unpermute_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q or k projection back from llama.cpp's rope order."""
    dim = t.shape[0] // heads // 2
    return t.reshape(heads, dim, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def _not_served(path: str | Path, tensor: str, type_name: str) -> GGUFError:
    return GGUFError(f"{Path(path).name}: tensor {tensor} is {type_name}; the quantized "
                     f"weights serve {', '.join(SERVED)} as they are (--quantization auto "
                     f"serves such tensors dequantized, none the whole file)")


class Served(dict):
    """read_quantized's answer: the packed tensors by Hugging Face name, and `skipped`, the
    tensors left dense (the file's tensor name -> GGML type)."""

    def __init__(self, tensors: dict[str, QuantTensor], skipped: dict[str, str]) -> None:
        super().__init__(tensors)
        self.skipped = skipped


def read_quantized(path: str | Path, num_heads: int, num_kv_heads: int, strict: bool = True,
                   family: str = "llama") -> Served:
    """Every quantized projection and embedding of the file by its Hugging Face name, packed;
    q and k rows put back in rope order where the family's converter permuted them. A tensor
    in a type not served: strict raises GGUFError naming the tensor and type; else it is left
    out (served dense from the converted folder) and listed in `skipped`."""
    import gguf

    family = FAMILIES[family]
    reader = gguf.GGUFReader(str(path))
    out: dict[str, QuantTensor] = {}
    skipped: dict[str, str] = {}
    for tensor in reader.tensors:
        type_name = tensor.tensor_type.name
        name = hf_name(tensor.name, family.gguf_names)
        if type_name in DENSE or name is None:
            continue
        if type_name not in SERVED:
            if strict:
                raise _not_served(path, tensor.name, type_name)
            skipped[tensor.name] = type_name
            continue
        kind = SERVED[type_name][0]
        if len(tensor.shape) == 3:  # stacked experts (K, N, E): each expert packed alone
            k, n, experts = (int(s) for s in tensor.shape)
            data = np.asarray(tensor.data).reshape(experts, n, -1)
            packed = torch.stack([pack_parsed(type_name, parse_blocks(type_name, data[e], n, k))
                                  for e in range(experts)])
            out[name] = QuantTensor(type_name, kind, packed, (n, k))
            continue
        k, n = (int(s) for s in tensor.shape)  # GGUF lists the row length first
        parsed = parse_blocks(type_name, tensor.data, n, k)
        heads = num_heads if ".attn_q." in tensor.name else num_kv_heads
        if family.gguf_rope_permuted and (".attn_q." in tensor.name
                                          or ".attn_k." in tensor.name):
            parsed = tuple(None if t is None else unpermute_rows(t, heads) for t in parsed)
        out[name] = QuantTensor(type_name, kind, pack_parsed(type_name, parsed), (n, k))
    return Served(out, skipped)


def experts_served(path: str | Path, reader=None) -> bool:
    """Every stacked expert tensor of the file is in a SERVED type, with rows that stack into
    whole panels (SparseMoE.load_quantized takes them all as blocks): the dense experts need
    not be loaded at all. False for a file without experts. Reads the header only (reader:
    the file's gguf.GGUFReader where the caller has one open)."""
    import gguf

    reader = reader or gguf.GGUFReader(str(path))
    experts = [t for t in reader.tensors if t.name.endswith("_exps.weight")]
    return bool(experts) and all(t.tensor_type.name in SERVED
                                 and int(t.shape[1]) % quant_layout.COLS == 0 for t in experts)


def served_bytes(path: str | Path) -> int:
    """The bytes a file's tensors take once served as blocks: about the file's size, except
    MXFP4, whose 4.25 bits a weight become s8's 8.5 (the header only is read)."""
    import gguf

    s8 = quant_layout.RECORD_BYTES["s8"] / (quant_layout.COLS * quant_layout.GROUP)
    return sum(int(t.n_elements * s8) if t.tensor_type.name == "MXFP4" else int(t.n_bytes)
               for t in gguf.GGUFReader(str(path)).tensors)


def dense_experts(path: str | Path, family: str) -> dict[str, torch.Tensor]:
    """A file's stacked experts dequantized (fp32), by the checkpoint's per-expert names: what
    a dense load takes in their place where the converted folder left them out (its experts
    are served as blocks: gguf_convert.convert) and blocks cannot run (quantization none,
    tensor parallel)."""
    import gguf
    from gguf.quants import dequantize

    from .moe import split_stacked

    names = FAMILIES[family].gguf_names
    out: dict[str, torch.Tensor] = {}
    for tensor in gguf.GGUFReader(str(path)).tensors:
        name = hf_name(tensor.name, names)
        if name is None or not tensor.name.endswith("_exps.weight"):
            continue
        shape = tuple(reversed([int(s) for s in tensor.shape]))
        stacked = torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type),
                                            dtype=np.float32).reshape(shape))
        out.update(split_stacked(name, stacked))
    return out


# safetensors inside, not named *.safetensors: the loader reads every such file of the folder
PACKED = "gguf-blocks.packed"
PACKED_VERSION = "4"  # raise when quant_layout's bytes or parse_blocks' output change


def _file_key(path: Path) -> str:
    stat = path.stat()
    return f"{PACKED_VERSION}:{stat.st_size}:{stat.st_mtime_ns}"


def read_quantized_cached(path: str | Path, num_heads: int, num_kv_heads: int,
                          folder: Path | None, strict: bool = True,
                          family: str = "llama") -> Served:
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
                skipped = json.loads(meta.get("skipped", "{}"))
                if strict and skipped:
                    raise _not_served(path, *next(iter(skipped.items())))
                return Served({name: QuantTensor(t, kind, f.get_tensor(name), tuple(shape))
                               for name, (t, kind, shape) in info.items()}, skipped)
    tensors = read_quantized(path, num_heads, num_kv_heads, strict, family)
    if cached is not None:
        tmp = None
        try:  # written beside, renamed into place: a reader never sees half a file
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=".packed-")
            os.close(fd)
            os.chmod(tmp, 0o644)  # as the folder's other files
            info = {n: (t.type_name, t.kind, list(t.shape)) for n, t in tensors.items()}
            save_file({n: t.packed for n, t in tensors.items()}, tmp,
                      metadata={"key": _file_key(path), "tensors": json.dumps(info),
                                "skipped": json.dumps(tensors.skipped)})
            os.replace(tmp, cached)
        except OSError:  # a read-only cache: parse each time
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
    return tensors


def fuse_rows(parts: list[QuantTensor]) -> torch.Tensor | None:
    """Packed weights stacked by rows (q, k, v into qkv; gate, up), each part repacked into
    s8hm where they differ in kind (exact: every kind's codes and scales fit it), or None
    where a part's rows are not whole panels (their packing would need a repack)."""
    if any(p.shape[0] % quant_layout.COLS for p in parts[:-1]):
        return None
    if len({p.kind for p in parts}) != 1:
        return torch.cat([quant_layout.as_s8hm(p.packed, p.shape[0]) for p in parts],
                         dim=0)
    return torch.cat([p.packed for p in parts], dim=0)


def fuse_expert_rows(gate: QuantTensor, up: QuantTensor) -> torch.Tensor | None:
    """Stacked experts' gate and up blocks [E, ...] -> each expert's gate and up rows in one
    packed weight (fuse_rows), stacked again; None where an expert's rows do not fuse."""
    fused = [fuse_rows([QuantTensor(t.type_name, t.kind, t.packed[e], t.shape)
                        for t in (gate, up)]) for e in range(gate.packed.shape[0])]
    return None if any(f is None for f in fused) else torch.stack(fused)


def types_of(tensors: dict[str, QuantTensor]) -> str:
    """The source types served, with how many tensors each: 'Q4_1 x210, Q8_0 x1', and the
    ones left dense: '; dense (no block form): Q5_K x12'."""
    def count(types) -> str:
        counts: dict[str, int] = {}
        for t in types:
            counts[t] = counts.get(t, 0) + 1
        return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))

    served = count(t.type_name for t in tensors.values())
    skipped = getattr(tensors, "skipped", None)
    return served + (f"; dense (no block form): {count(skipped.values())}"
                     if skipped else "")
