"""sample: batched top-k / top-p / min-p sampling without sorting the vocabulary.

Each program takes BLOCK_R rows and streams over the vocabulary in BLOCK_V chunks:
1. max and argmax of the logits (temperature 0 rows end here: an exact argmax);
2. e = exp((logit - max) / T) lies in [0, 1] with e = 1 at the top token. Top-k and top-p
   thresholds are found by bisection over the bit pattern of e (positive floats order like
   their bits): 30 halvings of [0, bits(1.0)] land exactly on the k-th largest value, and on
   the smallest value whose "mass at or above it" reaches top_p of the top-k mass. Min-p is
   simply e >= min_p. A token is kept when e >= max(all three thresholds): ties are kept;
3. the exponential race argmax(e / E), E = -log(U), U from tl.rand(seed, column), draws from
   the kept, renormalised distribution with no cumulative sum and no host sync.
Each bisection pass re-reads the row (60 extra passes when both filters are on), which is
cheap next to a full sort when the row stays in L2.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import interpreting

_ONE_BITS_PLUS_ONE = 0x3F800001  # bit pattern of 1.0f, plus one
_BISECTION_STEPS = 30  # 2**30 > _ONE_BITS_PLUS_ONE


@triton.jit
def _exp_scores(logits_ptr, stride, rows, row_mask, start, best, inv_t, V,
                BLOCK_V: tl.constexpr):
    cols = start + tl.arange(0, BLOCK_V)
    valid = row_mask[:, None] & (cols < V)[None, :]
    x = tl.load(logits_ptr + rows[:, None] * stride + cols[None, :], mask=valid,
                other=float("-inf")).to(tl.float32)
    e = tl.exp((x - best[:, None]) * inv_t[:, None])  # [BLOCK_R, BLOCK_V] in [0, 1]
    return tl.where(valid, e, 0.0), cols, valid


@triton.jit
def _sample_kernel(logits_ptr, stride, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr,
                   out_ptr, B, V, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
                   STEPS: tl.constexpr, ONE_PLUS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < B
    temp = tl.load(temp_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    greedy = temp <= 0.0
    inv_t = 1.0 / tl.where(greedy, 1.0, temp)

    best = tl.full([BLOCK_R], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK_R], tl.int32)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(logits_ptr + rows[:, None] * stride + cols[None, :],
                    mask=row_mask[:, None] & (cols < V)[None, :],
                    other=float("-inf")).to(tl.float32)
        chunk_max = tl.max(x, axis=1)
        chunk_arg = tl.argmax(x, axis=1).to(tl.int32) + start
        better = chunk_max > best
        best = tl.where(better, chunk_max, best)
        best_idx = tl.where(better, chunk_arg, best_idx)
    best = tl.where(row_mask, best, 0.0)  # padding rows: avoid -inf - -inf

    top_k = tl.load(top_k_ptr + rows, mask=row_mask, other=0).to(tl.int32)
    use_k = (top_k > 0) & (top_k < V) & ~greedy & row_mask
    t_k = tl.zeros([BLOCK_R], tl.float32)
    if tl.max(use_k.to(tl.int32), axis=0) > 0:
        lo = tl.zeros([BLOCK_R], tl.int32)
        hi = tl.full([BLOCK_R], ONE_PLUS, tl.int32)
        for _ in range(STEPS):
            mid = lo + (hi - lo) // 2
            t = mid.to(tl.float32, bitcast=True)
            count = tl.zeros([BLOCK_R], tl.int32)
            for start in range(0, V, BLOCK_V):
                e, cols, valid = _exp_scores(logits_ptr, stride, rows, row_mask, start, best,
                                             inv_t, V, BLOCK_V)
                count += tl.sum(((e >= t[:, None]) & valid).to(tl.int32), axis=1)
            ok = count >= top_k
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid)
        t_k = tl.where(use_k, lo.to(tl.float32, bitcast=True), 0.0)

    top_p = tl.load(top_p_ptr + rows, mask=row_mask, other=1.0).to(tl.float32)
    use_p = (top_p < 1.0) & ~greedy & row_mask
    t_p = tl.zeros([BLOCK_R], tl.float32)
    if tl.max(use_p.to(tl.int32), axis=0) > 0:
        kept_mass = tl.zeros([BLOCK_R], tl.float32)
        for start in range(0, V, BLOCK_V):
            e, cols, valid = _exp_scores(logits_ptr, stride, rows, row_mask, start, best,
                                         inv_t, V, BLOCK_V)
            kept_mass += tl.sum(tl.where(e >= t_k[:, None], e, 0.0), axis=1)
        target = top_p * kept_mass
        lo = tl.zeros([BLOCK_R], tl.int32)
        hi = tl.full([BLOCK_R], ONE_PLUS, tl.int32)
        for _ in range(STEPS):
            mid = lo + (hi - lo) // 2
            t = tl.maximum(mid.to(tl.float32, bitcast=True), t_k)
            mass = tl.zeros([BLOCK_R], tl.float32)
            for start in range(0, V, BLOCK_V):
                e, cols, valid = _exp_scores(logits_ptr, stride, rows, row_mask, start, best,
                                             inv_t, V, BLOCK_V)
                mass += tl.sum(tl.where(e >= t[:, None], e, 0.0), axis=1)
            ok = mass >= target
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid)
        t_p = tl.where(use_p, lo.to(tl.float32, bitcast=True), 0.0)

    min_p = tl.load(min_p_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    threshold = tl.maximum(tl.maximum(t_k, t_p), min_p)
    seed = tl.load(seed_ptr + rows, mask=row_mask, other=0)
    race_best = tl.full([BLOCK_R], -1.0, tl.float32)
    race_idx = best_idx
    for start in range(0, V, BLOCK_V):
        e, cols, valid = _exp_scores(logits_ptr, stride, rows, row_mask, start, best, inv_t,
                                     V, BLOCK_V)
        u = tl.rand(tl.broadcast_to(seed[:, None], [BLOCK_R, BLOCK_V]),  # in [0, 1)
                    tl.broadcast_to(cols[None, :], [BLOCK_R, BLOCK_V]))
        race = e / -tl.log(u)
        race = tl.where(valid & (e >= threshold[:, None]) & (e > 0.0), race, -1.0)
        chunk_max = tl.max(race, axis=1)
        chunk_arg = tl.argmax(race, axis=1).to(tl.int32) + start
        better = chunk_max > race_best
        race_best = tl.where(better, chunk_max, race_best)
        race_idx = tl.where(better, chunk_arg, race_idx)

    token = tl.where(greedy, best_idx, race_idx)
    tl.store(out_ptr + rows, token.to(tl.int64), mask=row_mask)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
           top_p: torch.Tensor, min_p: torch.Tensor, seeds: torch.Tensor,
           block_rows: int | None = None, block_v: int | None = None) -> torch.Tensor:
    """logits [B, V]; temperature, top_p, min_p float [B]; top_k int [B] (<= 0 off);
    seeds int64 [B] -> token ids int64 [B]. The same seeds give the same tokens.
    block_rows / block_v default to the GPU's choice (the interpreter's when interpreting);
    tests pass the GPU's to run its large-vocabulary path in the interpreter."""
    batch, vocab = logits.shape
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return out
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    if block_v is None:
        block_v = min(triton.next_power_of_2(vocab), 1024 if interpreting() else 4096)
    if block_rows is None:
        block_rows = 64 if interpreting() else (16 if vocab <= 2048 else 1)
    _sample_kernel[(triton.cdiv(batch, block_rows),)](
        logits, logits.stride(0), temperature.float().contiguous(), top_k.int().contiguous(),
        top_p.float().contiguous(), min_p.float().contiguous(), seeds.long().contiguous(), out,
        batch, vocab, BLOCK_R=block_rows, BLOCK_V=block_v, STEPS=_BISECTION_STEPS,
        ONE_PLUS=_ONE_BITS_PLUS_ONE)
    return out
