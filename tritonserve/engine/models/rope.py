"""Rotary position tables, one per Rope recipe (engine/models/family.py): the inverse
frequencies of each rope kind (default, linear, llama3, yarn, longrope, dynamic), the
attention factor some kinds put on cos and sin, and partial rotary (the first fraction of a
head rotated, the rest passed through).

Kinds whose frequencies depend on the sequence's length in transformers (longrope picks its
short or long factors by the longest position of the forward; dynamic NTK grows its base past
the original context) are made per position here, as vLLM does: positions inside the
original context use the short factors / the plain base, positions past it the long factors /
the base grown for the engine's longest context. Inside the original context (every test) the
two agree exactly; past it a key keeps the rotation it was cached with, which a cached
forward in transformers does too.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from . import ops
from .family import Rope

RopeTables = tuple[torch.Tensor, torch.Tensor]  # cos, sin [T, 1, rotary_dim]


def _exponents(dim: int) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim


def _llama3(rope: Rope, inv_freq: torch.Tensor) -> torch.Tensor:
    factor = float(rope.get("factor"))
    low_freq_factor = float(rope.get("low_freq_factor", 1.0))
    high_freq_factor = float(rope.get("high_freq_factor", 4.0))
    old_len = float(rope.get("original_max_position_embeddings") or 8192)
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: Rope, dim: int) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): interpolated low frequencies, extrapolated high ones, a
    linear ramp between the correction dims; cos and sin times the attention factor."""
    base = rope.theta
    original = float(rope.get("original_max_position_embeddings"))
    factor = rope.get("factor") or float(rope.get("max_position_embeddings")) / original
    factor = float(factor)
    attention = rope.get("attention_factor")
    mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")
    if attention is None:
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                     if mscale and mscale_all else _yarn_mscale(factor))
    beta_fast = rope.get("beta_fast") or 32
    beta_slow = rope.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** _exponents(dim)
    extrapolate = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention)


def _longrope_factor(rope: Rope) -> float:
    original = float(rope.get("original_max_position_embeddings"))
    factor = rope.get("factor") or float(rope.get("max_position_embeddings")) / original
    attention = rope.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(
            1 + math.log(factor) / math.log(original))
    return float(attention)


def rope_tables(rope: Rope, head_dim: int, max_positions: int) -> tuple[torch.Tensor,
                                                                          torch.Tensor]:
    """cos, sin [max_positions, rotary_dim] in fp32 (rotate-half layout: the frequencies
    twice), the attention factor already on them."""
    dim = int(head_dim * rope.fraction)
    positions = torch.arange(max_positions, dtype=torch.float32)
    inv_freq = 1.0 / (rope.theta ** _exponents(dim))
    attention = 1.0
    freqs = None
    if rope.kind == "linear":
        inv_freq = inv_freq / float(rope.get("factor"))
    elif rope.kind == "llama3":
        inv_freq = _llama3(rope, inv_freq)
    elif rope.kind == "yarn":
        inv_freq, attention = _yarn(rope, dim)
    elif rope.kind == "longrope":
        original = int(rope.get("original_max_position_embeddings"))
        short, long = (torch.tensor(rope.get(k), dtype=torch.float32)
                       for k in ("short_factor", "long_factor"))
        base = rope.theta ** _exponents(dim)
        freqs = torch.where((positions < original)[:, None],
                            torch.outer(positions, 1.0 / (short * base)),
                            torch.outer(positions, 1.0 / (long * base)))
        attention = _longrope_factor(rope)
    elif rope.kind == "dynamic":
        original = int(rope.get("original_max_position_embeddings"))
        factor = float(rope.get("factor"))
        longest = max(max_positions, original)
        grown = rope.theta * ((factor * longest / original) - (factor - 1)) ** (dim / (dim - 2))
        far = 1.0 / (grown ** _exponents(dim))
        freqs = torch.where((positions < original)[:, None], torch.outer(positions, inv_freq),
                            torch.outer(positions, far))
    if freqs is None:
        freqs = torch.outer(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * attention, emb.sin() * attention


class RotaryEmbedding(nn.Module):
    """Non-interleaved (rotate-half) rope with a precomputed cos/sin table for one Rope."""

    def __init__(self, rope: Rope, head_dim: int, max_positions: int) -> None:
        super().__init__()
        cos, sin = rope_tables(rope, head_dim, max_positions)  # [max_positions, rotary_dim]
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """Once a step, not once a layer: positions [T] -> cos, sin [T, 1, rotary_dim]."""
        return (self.cos[positions].unsqueeze(1).to(dtype),
                self.sin[positions].unsqueeze(1).to(dtype))

    @staticmethod
    def apply(x: torch.Tensor, tables: RopeTables) -> torch.Tensor:
        """x [T, heads, head_dim] rotated by its positions' tables (models/ops.py: Rope); a
        partial table rotates the first rotary_dim dims and passes the rest."""
        rotary = tables[0].shape[-1]
        if rotary == x.shape[-1]:
            return ops.rope(x, *tables)
        return torch.cat((ops.rope(x[..., :rotary].contiguous(), *tables), x[..., rotary:]),
                         dim=-1)
