"""The packed layout of a weight-only quantized matmul weight, written once: pack (scales and
integer codes -> uint8 panels), unpack and the plain-torch reference (panels -> fp32 weight).
kernels/cpu/panels_quant.h reads it (the C++ matmul) and states the bytes:

- u4: weight[n, k] = d[n, g] * q[n, k] + m[n, g], q in 0..15, g = k // 32 (GGUF Q4_1; Q4_0
  with m = -8 d; int4 with a zero point z: m = -z d); the codes of 8 k and a column in one
  32-bit word, k 2 i + h at bits 4 (i + 4 h), so a k pair is a shift and a mask away
- s8: weight[n, k] = d[n, g] * q[n, k], q in -128..127 (GGUF Q8_0; int8)
- s8h: weight[n, k] = (d[n, g] * s[n, k // 16]) * q[n, k], q in -128..127 and s an int8 scale
  a half group of 16 k (GGUF Q6_K: its super block's d, its 16-wide sub blocks' scales, codes
  less 32; the product d * s is exact in fp32, as gguf's dequantizer forms it)
- s8hm: weight[n, k] = (d[n, g] * s[n, k // 16]) * q[n, k] + m[n, g]: every other kind in one
  (GGUF Q5_1 and Q5_K, whose 5-bit codes need a byte and an offset; a fused projection whose
  parts came in different kinds, each part's codes and scales as they were: `as_s8hm`)

d and m are fp16, as in the GGUF blocks, so a block is the same bytes here as in the file.
Panels of 16 output rows, records of 32 k: uint8 [ceil(N / 16), K / 32, 320 (u4), 544 (s8),
576 (s8h) or 608 (s8hm)]; rows past N are zero.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

COLS = 16
GROUP = 32
HALF = 16  # k a sub-block scale of the HALVED kinds


@dataclass(frozen=True)
class QuantKind:
    """One packed kind, named: the C++ op (kernels/cpu/panels_quant.h's Kind and its
    quant_kinds() table) and the Triton kernel (kernels/triton/quant_matmul.py's constexprs)
    take these fields from here; tests/test_quant_kinds.py fails where a side disagrees.
    id: the kind's number in both; code_bits: 4 (unsigned 0..15) or 8 (int8); record_bytes: a
    32-k record of a 16-column panel; codes_at: where its codes start in the record (after
    d, the offsets m and the half-group scales s); halves: scales a group (2: an int8 scale
    every 16 k under d); offset: an fp16 m a group. gguf: the GGUF block types it serves."""

    name: str
    id: int
    code_bits: int
    record_bytes: int
    codes_at: int
    halves: int
    offset: bool
    gguf: tuple[str, ...]

    @property
    def header_bytes(self) -> int:
        """d, then m where the kind has it, then the half-group scales: 2 bytes a column
        each for d and m, one a column a half for s."""
        return 2 * COLS * (1 + self.offset) + (COLS * self.halves if self.halves > 1 else 0)


KINDS = (QuantKind("u4", 0, 4, 64 + 256, 64, 1, True, ("Q4_0", "Q4_1", "Q4_K")),
         QuantKind("s8", 1, 8, 32 + 512, 32, 1, False, ("Q8_0", "Q5_0", "MXFP4")),
         QuantKind("s8h", 2, 8, 64 + 512, 64, 2, False, ("Q6_K",)),
         QuantKind("s8hm", 3, 8, 96 + 512, 96, 2, True, ("Q5_1", "Q5_K")))
BY_NAME = {k.name: k for k in KINDS}
RECORD_BYTES = {k.name: k.record_bytes for k in KINDS}
CODES_AT = {k.name: k.codes_at for k in KINDS if k.code_bits == 8}  # the s8 kinds' codes
HALVED = tuple(k.name for k in KINDS if k.halves == 2)  # a scale a half group
OFFSET = tuple(k.name for k in KINDS if k.offset)  # an offset m a group
_KINDS = {size: kind for kind, size in RECORD_BYTES.items()}  # kind_of runs once a matmul call


def kind_of(weight: torch.Tensor) -> str | None:
    """The kind of a packed weight (u4, s8, s8h, s8hm), None for anything else."""
    if weight.dtype != torch.uint8 or weight.dim() != 3:
        return None
    return _KINDS.get(weight.shape[2])


def pack(kind: str, d: torch.Tensor, q: torch.Tensor, m: torch.Tensor | None = None, *,
         sub: torch.Tensor | None = None) -> torch.Tensor:
    """d, m [N, G] (any float dtype: stored as fp16), q [N, K = 32 G] integer codes (u4: 0..15,
    the s8 kinds: -128..127) -> uint8 panels. m for u4 and s8hm (None: zero); sub, the int8
    scales [N, K / 16] of each half group, for s8h and s8hm (required there, refused
    elsewhere)."""
    if kind not in RECORD_BYTES:
        raise ValueError(f"kind must be one of {sorted(RECORD_BYTES)}, got {kind!r}")
    n, k = q.shape
    if k % GROUP or d.shape != (n, k // GROUP):
        raise ValueError(f"q must be [N, K] with K a multiple of {GROUP} and d [N, K / {GROUP}]; "
                         f"got q {tuple(q.shape)}, d {tuple(d.shape)}")
    lo, hi = (0, 15) if kind == "u4" else (-128, 127)
    if q.numel() and (int(q.min()) < lo or int(q.max()) > hi):
        raise ValueError(f"{kind} codes must lie in [{lo}, {hi}]")
    if (kind in HALVED) != (sub is not None):
        raise ValueError("sub (the half groups' int8 scales) is s8h's and s8hm's, and they "
                         "need it")
    if sub is not None and (sub.shape != (n, k // HALF) or (sub.numel() and (
            int(sub.min()) < -128 or int(sub.max()) > 127))):
        raise ValueError(f"sub must be int8 values [N, K / {HALF}]; got {tuple(sub.shape)}")
    if m is not None and kind not in OFFSET:
        raise ValueError(f"m (the groups' offsets) is u4's and s8hm's, not {kind}'s")
    groups, panels = k // GROUP, -(-n // COLS)
    rows = panels * COLS

    def padded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        out = torch.zeros((rows, *t.shape[1:]), dtype=dtype)
        out[:n] = t.to(dtype)
        return out

    def scales(t: torch.Tensor) -> torch.Tensor:  # [N, G] -> [P, G, 16 * 2 bytes]
        half = padded(t, torch.float16).view(panels, COLS, groups).transpose(1, 2)
        return half.contiguous().view(torch.uint8).reshape(panels, groups, 2 * COLS)

    codes = padded(q, torch.int16).view(panels, COLS, groups, GROUP)
    codes = codes.permute(0, 2, 3, 1)  # [P, G, 32 k, 16 cols]
    m = torch.zeros_like(d) if m is None else m
    if kind == "u4":  # blocks of 8 k: nibble 4 h + i of a column's word = k 2 i + h
        blocks = codes.reshape(panels, groups, 4, 4, 2, COLS).to(torch.int64)
        shifts = (4 * (torch.arange(4).view(4, 1) + 4 * torch.arange(2).view(1, 2)))
        words = (blocks << shifts.view(1, 1, 1, 4, 2, 1)).sum(dim=(3, 4))  # [P, G, 4, 16]
        words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)  # as int32 bits
        body = words.to(torch.int32).contiguous().view(torch.uint8)  # little-endian words
        return torch.cat([scales(d), scales(m), body.reshape(panels, groups, -1)],
                         dim=2).contiguous()
    parts = [scales(d)] + ([scales(m)] if kind in OFFSET else [])
    if sub is not None:  # s[h][c] at 16 h + c of the record's scale bytes
        halves = padded(sub, torch.int8).view(panels, COLS, groups, 2).permute(0, 2, 3, 1)
        parts.append(halves.contiguous().view(torch.uint8).reshape(panels, groups, -1))
    parts.append(codes.to(torch.int8).contiguous().view(torch.uint8).reshape(panels, groups, -1))
    return torch.cat(parts, dim=2).contiguous()


def factors(weight: torch.Tensor, n: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """packed panels -> what pack took, for any kind: (d [N, G] fp32, q [N, K] int16, m [N, G]
    fp32 (zero where the kind has none), sub [N, K / 16] int16 (one where it has none))."""
    kind = kind_of(weight)
    if kind is None:
        raise ValueError("not a packed quantized weight (uint8 [P, G, "
                         f"{', '.join(str(b) for b in RECORD_BYTES.values())}])")
    panels, groups, _ = weight.shape

    def scales(offset: int) -> torch.Tensor:  # -> [N, G] fp32
        half = weight[:, :, offset:offset + 2 * COLS].contiguous().view(torch.float16)
        return half.transpose(1, 2).reshape(panels * COLS, groups)[:n].float()

    d = scales(0)
    m = scales(32) if kind in OFFSET else torch.zeros_like(d)
    sub = torch.ones((d.shape[0], 2 * groups), dtype=torch.int16, device=weight.device)
    if kind == "u4":
        words = weight[:, :, 64:].contiguous().view(torch.int32).to(torch.int64)
        words = words.reshape(panels, groups, 4, 1, 1, COLS) & 0xFFFFFFFF
        steps = torch.arange(4, device=weight.device)
        shifts = 4 * (steps.view(4, 1) + 4 * steps[:2].view(1, 2))
        codes = (words >> shifts.view(1, 1, 1, 4, 2, 1)) & 15  # [P, G, 4, 4 i, 2 h, 16]
    else:
        at = CODES_AT[kind]
        body = weight[:, :, at:].contiguous().view(torch.int8)
        codes = body.reshape(panels, groups, GROUP, COLS).to(torch.int16)
        if kind in HALVED:
            sub = weight[:, :, at - 32:at].contiguous().view(torch.int8).reshape(
                panels, groups, 2, COLS).permute(0, 3, 1, 2).reshape(panels * COLS, 2 * groups)
            sub = sub[:n].to(torch.int16)
    codes = codes.reshape(panels, groups, GROUP, COLS).permute(0, 3, 1, 2)
    return d, codes.reshape(panels * COLS, groups * GROUP)[:n], m, sub


def unpack(weight: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """packed panels -> (d [N, G] fp32, q [N, K] int16, m [N, G] fp32; zero for s8). s8h and
    s8hm: d is each half group's scale d * s [N, 2 G] (exact in fp32), m its group's offset
    (zero for s8h) in that shape."""
    d, q, m, sub = factors(weight, n)
    if kind_of(weight) in HALVED:
        return (d.repeat_interleave(2, dim=1) * sub.float(), q,
                m.repeat_interleave(2, dim=1))
    return d, q, m


def as_s8hm(weight: torch.Tensor, n: int) -> torch.Tensor:
    """A packed weight of any kind as s8hm, which holds every kind exactly: its codes and fp16
    scales as they were (a fused projection whose parts came in different kinds)."""
    d, q, m, sub = factors(weight, n)
    return pack("s8hm", d, q, m, sub=sub)


def dequantize(weight: torch.Tensor, n: int) -> torch.Tensor:
    """The reference: packed panels -> the fp32 weight [N, K] (d * q + m, per group)."""
    d, q, m = unpack(weight, n)
    width = q.shape[1] // max(d.shape[1], 1)  # k a scale: 32, or 16 (s8h, s8hm)
    return q.float() * d.repeat_interleave(width, dim=1) + m.repeat_interleave(width, dim=1)


def linear(x: torch.Tensor, weight: torch.Tensor, n: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference of packed_linear_quant: x [M, K] @ dequantize(weight)^T (+ bias)."""
    out = x.float() @ dequantize(weight, n).t()
    return out if bias is None else out + bias.float()


def quantize(weight: torch.Tensor, kind: str, group: int = GROUP) -> torch.Tensor:
    """A dense weight [N, K] (K a multiple of `group`, itself a multiple of 32) -> packed
    panels. u4 (int4): per group of `group` k (32, 64, 128), scale d = (max - min) / 15 and
    offset m = min (GGUF Q4_1's scheme), q = round((w - m) / d), each record of 32 k holding
    its group's d and m (the bytes of groups of 32 either way: larger groups only match a
    checkpoint's scheme); s8 (int8): per output row, symmetric, d = max |w| / 127,
    q = round(w / d); s8h (6-bit, GGUF Q6_K's scheme with a d a group of 32 where Q6_K has
    one a super block of 256): per 16 k a step max |w| / 31 as d * s, s = round(step / d) in
    0..127 and d = the group's largest step / 127, q = round(w / (d s)) in -32..31 (group 32
    only). Scales are rounded to fp16 first and the codes computed against the stored
    scales."""
    n, k = weight.shape
    if group % GROUP or k % group:
        raise ValueError(f"quantize: the row length {k} is not a multiple of the group "
                         f"{group}, or the group not a multiple of {GROUP}")
    w = weight.detach().float().reshape(n, k // group, group)
    if kind == "u4":
        lo, hi = w.amin(dim=2), w.amax(dim=2)
        d = ((hi - lo) / 15).half().float()
        m = lo.half().float()
        safe = torch.where(d > 0, d, torch.ones_like(d))
        q = torch.round((w - m.unsqueeze(2)) / safe.unsqueeze(2)).clamp(0, 15)
        wide = group // GROUP
        return pack(kind, d.repeat_interleave(wide, dim=1), q.reshape(n, k).to(torch.int16),
                    m.repeat_interleave(wide, dim=1))
    if kind == "s8":
        amax = w.abs().amax(dim=(1, 2))
        d = (amax / 127).half().float()
        safe = torch.where(d > 0, d, torch.ones_like(d))
        q = torch.round(w / safe[:, None, None]).clamp(-127, 127)
        return pack(kind, d[:, None].expand(n, k // GROUP), q.reshape(n, k).to(torch.int16))
    if kind == "s8h" and group == GROUP:
        halves = w.reshape(n, k // HALF, HALF)
        step = halves.abs().amax(dim=2) / 31  # [N, K / 16]
        d = (step.reshape(n, k // GROUP, 2).amax(dim=2) / 127).half().float()
        d16 = torch.where(d > 0, d, torch.ones_like(d)).repeat_interleave(2, dim=1)
        sub = torch.round(step / d16).clamp(0, 127)
        scale = d16 * sub
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(halves / safe.unsqueeze(2)).clamp(-32, 31)
        return pack(kind, d, q.reshape(n, k).to(torch.int16), sub=sub.to(torch.int16))
    if kind == "s8h":
        raise ValueError(f"quantize: s8h has groups of {GROUP}, got {group}")
    raise ValueError(f"kind must be one of {sorted(RECORD_BYTES)}, got {kind!r}")


def nbytes(weight: torch.Tensor) -> int:
    return weight.numel() * weight.element_size()
