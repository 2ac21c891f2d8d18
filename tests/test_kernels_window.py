"""Sliding windows, score soft-caps and attention sinks (gpt-oss) in the paged attention
kernels (Triton decode and prefill, the C++ op) against reference.paged_attention_masked, and
that reference against a dense attention with the mask and the sink written out. The pages wholly before a row's window hold NaN:
a kernel that reads them fails."""
from __future__ import annotations

import pytest
import torch

from tritonserve.kernels import cpu, reference
from tritonserve.kernels import triton as kernels
from tests.test_kernels_attention import (POISON, close, make_cache, poison_tails,
                                          scattered_tables)

KV_HEADS = 2


def setup(seq_lens, block_size, head_dim, group, dtype, device, seed, q_lens=None):
    pool = sum(-(-n // block_size) for n in seq_lens) + 5
    k_cache, v_cache = make_cache(pool, block_size, KV_HEADS, head_dim, dtype, device, seed)
    tables = scattered_tables(seq_lens, block_size, pool, seed).to(device)
    poison_tails(k_cache, v_cache, tables, seq_lens, block_size)
    q_lens = q_lens or [1] * len(seq_lens)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32,
                      device=device)
    q = torch.randn(sum(q_lens), KV_HEADS * group, head_dim,
                    generator=torch.Generator().manual_seed(seed + 1)).to(dtype).to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, tables, cu, lens


def poison_before(k_cache, v_cache, tables, seq_lens, q_lens, window, block_size):
    """NaN in every page wholly before the window of each sequence's first query."""
    for row, (n, q_len) in enumerate(zip(seq_lens, q_lens)):
        first = max(0, n - q_len - window + 1)
        for page in tables[row, :first // block_size].tolist():
            k_cache[page] = POISON
            v_cache[page] = POISON


def dense(q, k_cache, v_cache, tables, cu, lens, scale, window, softcap, sinks=None):
    """Each query row against every key of its sequence with the mask written out; a head's
    sink as one more score whose value is zero."""
    out = torch.empty_like(q, dtype=torch.float32)
    group = q.shape[1] // k_cache.shape[2]
    for s, n in enumerate(lens.tolist()):
        keys = k_cache[tables[s].long()].flatten(0, 1)[:n].float()
        values = v_cache[tables[s].long()].flatten(0, 1)[:n].float()
        for i in range(int(cu[s]), int(cu[s + 1])):
            p = n - (int(cu[s + 1]) - i)  # the query's position
            for h in range(q.shape[1]):
                scores = keys[:, h // group] @ q[i, h].float() * scale
                if softcap:
                    scores = torch.tanh(scores / softcap) * softcap
                pos = torch.arange(n)
                mask = (pos <= p) & ((pos > p - window) if window else True)
                scores = scores.masked_fill(~mask, float("-inf"))
                if sinks is not None:
                    scores = torch.cat((scores, sinks[h].reshape(1).float()))
                weights = torch.softmax(scores, 0)[:n]
                out[i, h] = weights @ values[:, h // group]
    return out


@pytest.mark.parametrize("window, softcap", [(None, None), (7, None), (16, 2.0), (1, None),
                                             (None, 3.0)])
def test_the_masked_reference_is_dense_attention_with_the_mask(window, softcap):
    seq_lens, q_lens = [37, 20, 64], [1, 9, 30]
    q, k, v, tables, cu, lens = setup(seq_lens, 16, 16, 2, torch.float32, "cpu", 3, q_lens)
    expected = dense(q, k, v, tables, cu, lens, 0.3, window, softcap)
    if window:
        poison_before(k, v, tables, seq_lens, q_lens, window, 16)
    got = reference.paged_attention_masked(q, k, v, tables, cu, lens, 0.3, window, softcap)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    if window is None and softcap is None:
        plain = reference.paged_prefill_attention(q, k, v, tables, cu, lens, 0.3)
        torch.testing.assert_close(got, plain, atol=1e-5, rtol=1e-5)


def _sinks(heads: int, device="cpu") -> torch.Tensor:
    """Sink logits near the scores' range, so each moves its head's output."""
    return (torch.randn(heads, generator=torch.Generator().manual_seed(11)) * 2).to(device)


@pytest.mark.parametrize("window", [None, 7])
def test_the_reference_takes_sinks_as_one_more_score(window):
    seq_lens, q_lens = [37, 20, 64], [1, 9, 30]
    q, k, v, tables, cu, lens = setup(seq_lens, 16, 16, 2, torch.float32, "cpu", 3, q_lens)
    sinks = _sinks(q.shape[1])
    expected = dense(q, k, v, tables, cu, lens, 0.3, window, None, sinks)
    got = reference.paged_attention_masked(q, k, v, tables, cu, lens, 0.3, window, None, sinks)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    without = reference.paged_attention_masked(q, k, v, tables, cu, lens, 0.3, window)
    assert (without - got).abs().max() > 0.05


@pytest.mark.parametrize("window,splits,dtype", [(None, 1, torch.float32), (20, 2, torch.float32),
                                                 (None, 4, torch.bfloat16)])
def test_triton_decode_takes_sinks(window, splits, dtype, device):
    seq_lens = [130, 17, 40]
    q, k, v, tables, cu, lens = setup(seq_lens, 16, 64, 2, dtype, device, 5)
    sinks = _sinks(q.shape[1], device)
    expected = reference.paged_attention_masked(q, k, v, tables, cu, lens, 0.1, window, None,
                                                sinks)
    got = kernels.paged_decode_attention(q, k, v, tables, lens, 0.1, num_splits=splits,
                                         out=torch.full_like(q, POISON), window=window,
                                         sinks=sinks)
    close(got, expected, dtype)


@pytest.mark.parametrize("window,dtype", [(None, torch.float32), (12, torch.bfloat16)])
def test_triton_prefill_takes_sinks(window, dtype, device):
    shapes = [(40, 40), (7, 60)]
    q_lens, seq_lens = [a for a, _ in shapes], [b for _, b in shapes]
    q, k, v, tables, cu, lens = setup(seq_lens, 16, 64, 2, dtype, device, 7, q_lens)
    sinks = _sinks(q.shape[1], device)
    expected = reference.paged_attention_masked(q, k, v, tables, cu, lens, 0.2, window, None,
                                                sinks)
    got = kernels.paged_prefill_attention(q, k, v, tables, cu, lens, 0.2,
                                          out=torch.full_like(q, POISON), tile=(32, 32),
                                          window=window, sinks=sinks)
    close(got, expected, dtype)


DECODE = [  # (seq_lens, block_size, head_dim, group, dtype, window, softcap, splits)
    ([40, 100, 5], 16, 64, 4, torch.float32, 20, None, 1),
    ([130, 17], 16, 64, 2, torch.float32, 33, 5.0, 2),
    ([300, 64], 32, 128, 1, torch.float32, 64, None, 4),
    ([48, 9], 16, 64, 4, torch.bfloat16, 16, 3.0, 1),
    ([70, 3], 16, 64, 2, torch.float32, None, 2.0, 1),
]


@pytest.mark.parametrize("seq_lens,block_size,head_dim,group,dtype,window,softcap,splits",
                         DECODE)
def test_triton_decode_takes_the_window_and_softcap(seq_lens, block_size, head_dim, group,
                                                    dtype, window, softcap, splits, device):
    q, k, v, tables, cu, lens = setup(seq_lens, block_size, head_dim, group, dtype, device, 5)
    expected = reference.paged_attention_masked(q, k, v, tables, cu, lens, 0.1, window,
                                                softcap)
    if window:
        poison_before(k, v, tables, seq_lens, [1] * len(seq_lens), window, block_size)
    got = kernels.paged_decode_attention(q, k, v, tables, lens, 0.1, num_splits=splits,
                                         out=torch.full_like(q, POISON), window=window,
                                         softcap=softcap)
    close(got, expected, dtype)


PREFILL = [  # (shapes [(q_len, seq_len)], block_size, head_dim, group, dtype, window, softcap)
    ([(40, 40), (7, 60)], 16, 64, 2, torch.float32, 12, None),
    ([(33, 90), (5, 5)], 16, 64, 4, torch.float32, 40, 4.0),
    ([(20, 20), (9, 41)], 16, 64, 2, torch.bfloat16, 8, 2.0),
]


@pytest.mark.parametrize("shapes,block_size,head_dim,group,dtype,window,softcap", PREFILL)
def test_triton_prefill_takes_the_window_and_softcap(shapes, block_size, head_dim, group,
                                                     dtype, window, softcap, device):
    q_lens, seq_lens = [a for a, _ in shapes], [b for _, b in shapes]
    q, k, v, tables, cu, lens = setup(seq_lens, block_size, head_dim, group, dtype, device, 7,
                                      q_lens)
    expected = reference.paged_attention_masked(q, k, v, tables, cu, lens, 0.2, window,
                                                softcap)
    poison_before(k, v, tables, seq_lens, q_lens, window, block_size)
    got = kernels.paged_prefill_attention(q, k, v, tables, cu, lens, 0.2,
                                          out=torch.full_like(q, POISON), tile=(32, 32),
                                          window=window, softcap=softcap)
    close(got, expected, dtype)


@pytest.mark.skipif(cpu.op("paged_decode_attention") is None, reason="no C++ CPU library")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window, softcap", [(20, None), (5, 3.0), (None, 2.0), (1, None),
                                             (300, None)])
def test_the_cpu_op_takes_the_window_and_softcap(dtype, window, softcap):
    """Decode rows, and prefill rows run as decode rows (`cached`), as CpuAttention.masked
    calls them; head sizes 64 and 256 (unrolled kernels) and 48 (any size). A window of 300
    is past every row: the plain kernels run (the bf16 one for head size 64)."""
    op = cpu.op("paged_decode_attention")
    for head_dim in (64, 256, 48):
        seq_lens = [40, 100, 5, 17]
        q, k, v, tables, cu, lens = setup(seq_lens, 16, head_dim, 3, dtype, "cpu", 9)
        expected = reference.paged_attention_masked(q, k, v, tables, cu, lens, 0.15, window,
                                                    softcap)
        if window:
            poison_before(k, v, tables, seq_lens, [1] * 4, window, 16)
        for cached in (False, True):
            got = op(q, k, v, tables, lens, 0.15, cached, window or 0, softcap or 0.0)
            close(got, expected, dtype)


@pytest.mark.skipif(cpu.op("paged_decode_attention") is None, reason="no C++ CPU library")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
def test_the_cpu_op_takes_sinks(dtype, window):
    """Each head's sink logit in its softmax's denominator, decode and prefill rows, head
    sizes 64 (the unrolled kernel) and 48 (any size); without a window the op leaves its
    plain kernels for the portable one."""
    op = cpu.op("paged_decode_attention")
    for head_dim in (64, 48):
        seq_lens = [40, 100, 5, 17]
        q, k, v, tables, cu, lens = setup(seq_lens, 16, head_dim, 3, dtype, "cpu", 9)
        sinks = _sinks(q.shape[1])
        expected = reference.paged_attention_masked(q, k, v, tables, cu, lens, 0.15, window,
                                                    None, sinks)
        for cached in (False, True):
            got = op(q, k, v, tables, lens, 0.15, cached, window or 0, 0.0, sinks)
            close(got, expected, dtype)
