"""paged_prefill_attention: causal attention for new query tokens over the paged cache.

Grid: (sequence, KV head, tile of query positions). One program packs BLOCK_M rows: BLOCK_Q
query positions x the BLOCK_G query heads that share the KV head (GQA), so each K/V tile is
loaded once per group, not once per head (32 query / 8 KV heads: 4x fewer K/V reads).
Row r is position r // BLOCK_G, head r % BLOCK_G.

Sequence s's queries are its last q_len positions of seq_lens[s], so a cached prefix or
earlier chunks are read from the cache (the new tokens' K/V were written there first). Keys
are read TILE_N tokens (several pages) per iteration in two loops: the tiles every query of
the program sees in full (no mask at all), then the diagonal tiles (causal mask). Tiles past
the program's last query are never visited.

On CUDA the tile shape, warps and stages are autotuned per (group, head_dim, page size,
dtype); the interpreter (and a caller passing `tile=`) runs one fixed shape.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (attention_shapes, compute_in_fp32, dot_precision, int8_scales,
                      interpreting, load_kv_tile, online_softmax_update)
from .decode_attention import tile_tokens

DEFAULT_BLOCK_M = 64  # rows per program where nothing is tuned (the interpreter)
MAX_GROUP = 64  # query heads per KV head that fit a program's rows
# (BLOCK_M rows, TILE_N keys, num_warps, num_stages): what FlashAttention-2 and vLLM's
# prefill kernels choose between on Hopper-class GPUs; compile_check builds every one.
TUNING_SPACE = [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 4, 2), (128, 64, 8, 3),
                (128, 32, 4, 3), (64, 128, 4, 2), (128, 128, 8, 2)]
# fp32 (IEEE dots, unrolled into FMAs) gets one small tile: ptxas took 128 s for a 128-row
# fp32 variant and 122 s for 64 x 128 (sm_90, this machine), and fp32 on a GPU is a
# correctness mode, not a fast one.
FP32_TILE = (64, 32, 4, 2)


def tuning_space(fp32: bool) -> list[tuple[int, int, int, int]]:
    return [FP32_TILE] if fp32 else TUNING_SPACE


def _prune(configs, named_args, **kwargs):
    """The autotuner's configs for this call's dtype (tuning_space)."""
    wanted = tuning_space(bool(kwargs.get("FP32", named_args.get("FP32"))))
    return [c for c in configs
            if (c.kwargs["BLOCK_M"], c.kwargs["TILE_N"], c.num_warps, c.num_stages) in wanted]


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr,
                    cu_seqlens_q_ptr, seq_lens_ptr, out_ptr, scale, window, softcap, sinks_ptr,
                    stride_qt, stride_qh, stride_bts, stride_cb, stride_ct, stride_ch,
                    stride_ot, stride_oh,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP32: tl.constexpr,
                    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
                    WINDOWED: tl.constexpr, SOFTCAPPED: tl.constexpr, INT8: tl.constexpr,
                    SINKS: tl.constexpr):
    BLOCK_Q = BLOCK_M // BLOCK_G  # query positions per program (a constexpr)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if tile * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        context_start = seq_len - q_len  # tokens before the first new query
        r = tl.arange(0, BLOCK_M)
        qi = tile * BLOCK_Q + r // BLOCK_G  # [BLOCK_M] query index within the sequence
        g = r % BLOCK_G
        d = tl.arange(0, BLOCK_D)
        row_mask = (qi < q_len) & (g < GROUP)
        d_mask = d < HEAD_DIM
        q_rows = (q_start + qi) * stride_qt + (kv_head * GROUP + g) * stride_qh  # [BLOCK_M]
        q = tl.load(q_ptr + q_rows[:, None] + d[None, :],
                    mask=row_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
        if FP32:
            q = q.to(tl.float32)
        q_pos = context_start + qi  # [BLOCK_M]
        first_pos = context_start + tile * BLOCK_Q
        end_pos = tl.minimum(first_pos + BLOCK_Q, seq_len)  # one past the last query
        full_tiles = (first_pos + 1) // TILE_N  # tiles whose keys every query sees
        first_tile = full_tiles  # the first tile read with a mask
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        if WINDOWED or SOFTCAPPED:
            # every tile masked: from the window of the program's first query (the tiles
            # before it are not read); a finite start so a row whose window begins in a
            # later tile stays 0 (exp(-inf - -inf) would be NaN)
            if WINDOWED:
                first_tile = tl.maximum(first_pos - window + 1, 0) // TILE_N
            else:
                first_tile = 0
            full_tiles = 0
            m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for key_tile in range(0, full_tiles):
            k_pos = key_tile * TILE_N + tl.arange(0, TILE_N)  # [TILE_N], all < seq_len
            k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                                block_tables_ptr + seq * stride_bts, k_pos, k_pos, d, d_mask,
                                kv_head, stride_cb, stride_ct, stride_ch, BLOCK_SIZE, False,
                                FP32, INT8, HEAD_DIM)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_M, TILE_N]
            m_i, l_i, acc = online_softmax_update(s, v, m_i, l_i, acc, PRECISION)
        # the diagonal: key 0 is in the first tile any row visits, so no row's max stays -inf
        for key_tile in range(first_tile, tl.cdiv(end_pos, TILE_N)):
            k_pos = key_tile * TILE_N + tl.arange(0, TILE_N)
            in_range = k_pos < seq_len  # slots past seq_len may hold anything (even NaN)
            if WINDOWED:  # nor are the keys before every row's window read (a page freed)
                in_range = in_range & (k_pos > first_pos - window)
            k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                                block_tables_ptr + seq * stride_bts, k_pos, in_range, d, d_mask,
                                kv_head, stride_cb, stride_ct, stride_ch, BLOCK_SIZE, True,
                                FP32, INT8, HEAD_DIM)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            if SOFTCAPPED:  # softcap * tanh(s / softcap), tanh as 1 - 2 / (e^2x + 1)
                s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
            visible = (k_pos[None, :] <= q_pos[:, None]) & in_range[None, :]
            if WINDOWED:
                visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
            m_i, l_i, acc = online_softmax_update(s, v, m_i, l_i, acc, PRECISION)
        if SINKS:  # each head's sink logit in the denominator, weighing no value
            l_i += tl.exp(tl.load(sinks_ptr + kv_head * GROUP + g, mask=g < GROUP,
                                  other=0.0) - m_i)
        out = acc / l_i[:, None]
        o_rows = (q_start + qi) * stride_ot + (kv_head * GROUP + g) * stride_oh
        tl.store(out_ptr + o_rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & d_mask[None, :])


_tuned_prefill_kernel = triton.autotune(
    configs=[triton.Config({"BLOCK_M": m, "TILE_N": n}, num_warps=w, num_stages=s)
             for m, n, w, s in TUNING_SPACE + [FP32_TILE]],
    key=["GROUP", "HEAD_DIM", "BLOCK_SIZE", "FP32", "INT8"],
    prune_configs_by={"early_config_prune": _prune})(_prefill_kernel)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float,
                            max_q_len: int | None = None,
                            out: torch.Tensor | None = None,
                            tile: tuple[int, int] | None = None, window: int | None = None,
                            softcap: float | None = None,
                            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [total_query_tokens, num_heads, head_dim] -> out of the same shape.
    tile=(BLOCK_M rows, TILE_N keys) fixes the shape instead of autotuning it. window /
    softcap / sinks: reference.paged_attention_masked's (the tiles before a program's first
    window are not read)."""
    block_size, num_kv_heads, group = attention_shapes(q, k_cache, v_cache)
    total, num_heads, head_dim = q.shape
    if group > MAX_GROUP:
        raise ValueError(f"{group} query heads per KV head: at most {MAX_GROUP} supported")
    out = torch.empty_like(q) if out is None else out
    num_seqs = seq_lens.shape[0]
    if total == 0 or num_seqs == 0:
        return out
    q = q if q.stride(2) == 1 else q.contiguous()
    if max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    block_g = triton.next_power_of_2(group)
    int8, k_scale, v_scale = int8_scales(k_cache, v_cache)
    args = (q, k_cache, v_cache, k_scale, v_scale, block_tables, cu_seqlens_q, seq_lens, out,
            scale,
            window or 0, softcap or 0.0, q if sinks is None else sinks.float().contiguous(),
            q.stride(0), q.stride(1), block_tables.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), out.stride(0),
            out.stride(1))
    shape = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_G=block_g,
                 BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size,
                 FP32=compute_in_fp32(q.dtype) or int8, PRECISION=dot_precision(q.dtype),
                 WINDOWED=bool(window), SOFTCAPPED=bool(softcap), INT8=int8,
                 SINKS=sinks is not None)
    if tile is None and interpreting():
        tile = (max(DEFAULT_BLOCK_M, block_g), tile_tokens(block_size, q.dtype))
    if tile is not None:
        block_m, tile_n = tile
        if block_m < block_g:
            raise ValueError(f"tile rows {block_m} hold no query position of {block_g} heads")
        grid = (num_seqs, num_kv_heads, triton.cdiv(max_q_len, block_m // block_g))
        _prefill_kernel[grid](*args, **shape, BLOCK_M=block_m, TILE_N=tile_n)
    else:
        def grid(meta):
            return (num_seqs, num_kv_heads,
                    triton.cdiv(max_q_len, max(1, meta["BLOCK_M"] // block_g)))
        _tuned_prefill_kernel[grid](*args, **shape)
    return out
