"""paged_prefill_attention: causal attention for new query tokens over the paged cache.

Grid: (sequence, query head, tile of BLOCK_M query rows). Sequence s's queries are its last
q_len positions of seq_lens[s], so a cached prefix or earlier chunks are read from the cache
(the new tokens' K/V were written there first). Keys are read TILE_N tokens (several pages)
per iteration; tiles past the query tile's last position are never visited.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_cache_layout, compute_in_fp32, dot_precision
from .decode_attention import tile_tokens

BLOCK_M = 16


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_q_ptr,
                    seq_lens_ptr, out_ptr, scale,
                    stride_qt, stride_qh, stride_bts, stride_cb, stride_ct, stride_ch,
                    stride_ot, stride_oh,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
                    FP32: tl.constexpr, PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if tile * BLOCK_M < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        context_start = seq_len - q_len  # tokens before the first new query
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        row_mask = rows < q_len
        d_mask = d < HEAD_DIM
        q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + d[None, :],
                    mask=row_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
        if FP32:
            q = q.to(tl.float32)
        q_pos = context_start + rows  # [BLOCK_M]
        kv_head = head // GROUP
        last_pos = tl.minimum(context_start + (tile + 1) * BLOCK_M, seq_len)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for key_tile in range(0, tl.cdiv(last_pos, TILE_N)):
            k_pos = key_tile * TILE_N + tl.arange(0, TILE_N)  # [TILE_N], spanning several pages
            in_range = k_pos < seq_len  # slots past seq_len may hold anything (even NaN)
            block = tl.load(block_tables_ptr + seq * stride_bts + k_pos // BLOCK_SIZE,
                            mask=in_range, other=0).to(tl.int64)
            row = block * stride_cb + (k_pos % BLOCK_SIZE) * stride_ct + kv_head * stride_ch
            kv_mask = in_range[:, None] & d_mask[None, :]
            k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
            if FP32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_M, TILE_N]
            visible = (k_pos[None, :] <= q_pos[:, None]) & in_range[None, :]
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float,
                            max_q_len: int | None = None,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """q [total_query_tokens, num_heads, head_dim] -> out of the same shape."""
    check_cache_layout(k_cache, v_cache)
    total, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q heads {num_heads} x {head_dim} do not fit cache KV heads "
                         f"{num_kv_heads} x {cache_head_dim}")
    out = torch.empty_like(q) if out is None else out
    num_seqs = seq_lens.shape[0]
    if total == 0 or num_seqs == 0:
        return out
    q = q if q.stride(2) == 1 else q.contiguous()
    if max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    grid = (num_seqs, num_heads, triton.cdiv(max_q_len, BLOCK_M))
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, out, scale,
        q.stride(0), q.stride(1), block_tables.stride(0), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), out.stride(0), out.stride(1),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_M=BLOCK_M,
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size,
        TILE_N=tile_tokens(block_size, q.dtype), FP32=compute_in_fp32(q.dtype),
        PRECISION=dot_precision(q.dtype))
    return out
