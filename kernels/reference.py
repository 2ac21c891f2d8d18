"""Plain-torch references for every kernel, with the same signatures.

They are the ground truth in the kernel tests and the engine's attention and sampling path on
the CPU, so they are written to be both obviously right and vectorised over the batch.
"""
from __future__ import annotations

import torch


def store_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v [T, kv_heads, head_dim] into caches [blocks, block_size, kv_heads, head_dim] at
    slot = block * block_size + offset; slot -1 is padding and skipped."""
    slots = slot_mapping.long()
    if bool((slots < 0).any()):
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    # index_copy_ rather than an indexed assignment: 3x faster on the CPU
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """q [B, heads, d]; one new query per sequence attending to its first seq_lens[b] tokens.
    The G query heads of a KV head are the G "query rows" of one SDPA problem (GQA)."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_blocks = -(-int(seq_lens.max()) // block_size)
    blocks = block_tables[:, :num_blocks].reshape(-1).long()
    context = num_blocks * block_size
    keys = k_cache.index_select(0, blocks).view(batch, context, num_kv_heads, head_dim)
    values = v_cache.index_select(0, blocks).view(batch, context, num_kv_heads, head_dim)
    invalid = (torch.arange(context, device=q.device)[None, :]
               >= seq_lens[:, None].to(q.device))  # [B, L]
    # slots past a sequence's end may hold anything (even NaN): zero just those rows
    padding = invalid.view(-1).nonzero().squeeze(1)
    keys.view(-1, num_kv_heads, head_dim).index_fill_(0, padding, 0.0)
    values.view(-1, num_kv_heads, head_dim).index_fill_(0, padding, 0.0)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.view(batch, num_kv_heads, group, head_dim).to(keys.dtype),
        keys.transpose(1, 2), values.transpose(1, 2),  # [B, kvh, L, d]
        attn_mask=~invalid[:, None, None, :], scale=scale)  # [B, kvh, G, d]
    return out.reshape(batch, num_heads, head_dim).to(q.dtype)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [total_q, heads, d]; sequence s's queries are its last (cu[s+1]-cu[s]) positions of
    seq_lens[s], causal; earlier positions (a cached prefix, earlier chunks) come from the cache."""
    num_heads = q.shape[1]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        q_start, q_end = cu[s], cu[s + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        blocks = block_tables[s, :-(-seq_len // block_size)].long()
        keys = k_cache[blocks].flatten(0, 1)[:seq_len].float().transpose(0, 1)  # [kvh, L, d]
        values = v_cache[blocks].flatten(0, 1)[:seq_len].float().transpose(0, 1)
        qs = q[q_start:q_end].float().transpose(0, 1)  # [heads, q_len, d]
        if q_len == seq_len:  # no cached prefix: plain causal attention
            mask, causal = None, True
        else:  # query i sits at position seq_len - q_len + i
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
            causal = False
        attn = torch.nn.functional.scaled_dot_product_attention(  # 4-D takes the fast path
            qs[None], keys[None], values[None], attn_mask=mask, is_causal=causal, scale=scale,
            enable_gqa=group > 1)[0]  # [heads, q_len, d]
        out[q_start:q_end] = attn.transpose(0, 1).to(q.dtype)
    return out


CANDIDATES = 64  # rows with a filter look for their kept set among this many top tokens


def _thresholds(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor) -> torch.Tensor:
    """Per-row probability threshold by a full sort: keep tokens with p >= threshold (ties
    kept). top-k, then top-p over the top-k mass, then min-p relative to the top probability.
    The exact path, for the rows whose kept set the candidates do not cover."""
    vocab = probs.shape[-1]
    sorted_probs, _ = probs.sort(dim=-1, descending=True)  # [B, V]
    k = torch.where((top_k <= 0) | (top_k >= vocab), vocab, top_k).long()
    t_k = sorted_probs.gather(1, (k - 1)[:, None]).squeeze(1)  # [B]
    kept = torch.where(sorted_probs >= t_k[:, None], sorted_probs, 0.0)
    cumulative = kept.cumsum(dim=-1)
    target = top_p.float() * kept.sum(dim=-1)
    first = (cumulative < target[:, None]).sum(dim=-1).clamp(max=vocab - 1)
    t_p = torch.where(top_p >= 1.0, 0.0, sorted_probs.gather(1, first[:, None]).squeeze(1))
    t_m = min_p.float() * sorted_probs[:, 0]
    return torch.maximum(torch.maximum(t_k, t_p), t_m)


def uniform_from_seeds(seeds: torch.Tensor) -> torch.Tensor:
    """[B] int64 seeds -> [B] float64 uniforms in [0, 1): splitmix64's finaliser, a
    counter-based generator (the same seed gives the same number on any device, in any
    batch), computed for the whole batch in a few integer ops. int64 products wrap."""
    x = seeds.long() + 0x7F4A7C15
    x = (x ^ ((x >> 30) & 0x3FFFFFFFF)) * -0x40A7B892E31B1A47  # 0xBF58476D1CE4E5B9
    x = (x ^ ((x >> 27) & 0x1FFFFFFFFF)) * -0x6B2FB644ECCEEE15  # 0x94D049BB133111EB
    x = x ^ ((x >> 31) & 0x1FFFFFFFF)
    return ((x >> 11) & ((1 << 53) - 1)).double() * (1.0 / (1 << 53))


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """weights [R, N] >= 0 (not normalised), u [R] in [0, 1) -> [R] column whose cumulative
    weight first exceeds u x the row's total: exact sampling with one uniform per row, in
    any column order. Zero-weight columns are never chosen."""
    cumulative = weights.cumsum(dim=-1)
    target = (u * cumulative[:, -1].double()).to(cumulative.dtype)
    index = torch.searchsorted(cumulative, target[:, None], right=True).squeeze(1)
    return index.clamp(max=weights.shape[-1] - 1)


def _sample_full_rows(scaled: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Temperature only: softmax(scaled) sampled by inverse CDF over the vocabulary in its own
    order: exp, cumsum, a binary search. No sort and one random number per row."""
    weights = (scaled - scaled.max(dim=-1, keepdim=True).values).exp_()
    return _inverse_cdf(weights, u)


def _sample_filtered_rows(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                          min_p: torch.Tensor, u: torch.Tensor, candidates: int
                          ) -> torch.Tensor:
    """top-k / top-p / min-p rows: the thresholds are found among the top `candidates`
    tokens (torch.topk, no sort of the vocabulary). A row whose kept set may reach past the
    candidates (top_p not covered by them, or min_p keeping the last one) takes the exact
    full-sort path."""
    rows, vocab = scaled.shape
    k = torch.where((top_k <= 0) | (top_k >= vocab), vocab, top_k).long()  # [R]
    width = min(vocab, max(candidates, int(torch.where(k < vocab, k, 0).max())))
    values, columns = scaled.topk(width, dim=-1)  # [R, W], sorted descending
    shifted = scaled - values[:, :1]
    total = shifted.exp().sum(dim=-1)  # [R] softmax normaliser over the whole row
    probs = values.sub(values[:, :1]).exp_() / total[:, None]  # [R, W]
    in_k = torch.arange(width, device=scaled.device)[None, :] < k[:, None]
    t_k = torch.where(k <= width, probs.gather(1, (k.clamp(max=width) - 1)[:, None])
                      .squeeze(1), 0.0)
    kept_by_k = torch.where(in_k, probs, 0.0)
    mass_k = torch.where(k < vocab, kept_by_k.sum(dim=-1), 1.0)
    cumulative = kept_by_k.cumsum(dim=-1)
    target = top_p.float() * mass_k
    covered = (top_p >= 1.0) | (cumulative[:, -1] >= target)
    first = (cumulative < target[:, None]).sum(dim=-1).clamp(max=width - 1)
    t_p = torch.where(top_p >= 1.0, 0.0, probs.gather(1, first[:, None]).squeeze(1))
    threshold = torch.maximum(torch.maximum(t_k, t_p), min_p.float() * probs[:, 0])
    reaches_past = (width < vocab) & (k > width) & (probs[:, -1] >= threshold)
    exact = ~covered | reaches_past
    weights = torch.where(probs >= threshold[:, None], probs, 0.0)
    tokens = columns.gather(1, _inverse_cdf(weights, u)[:, None]).squeeze(1)
    if bool(exact.any()):
        rows_exact = exact.nonzero().squeeze(1)
        full = torch.softmax(scaled[rows_exact], dim=-1)
        keep = full >= _thresholds(full, top_k[rows_exact], top_p[rows_exact],
                                   min_p[rows_exact])[:, None]
        tokens[rows_exact] = _inverse_cdf(torch.where(keep, full, 0.0), u[rows_exact])
    return tokens


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
           top_p: torch.Tensor, min_p: torch.Tensor, seeds: torch.Tensor,
           candidates: int = CANDIDATES) -> torch.Tensor:
    """logits [B, V]; per-row parameters [B]. Temperature 0 is an exact argmax. Otherwise a
    token is drawn from the filtered softmax(logits / T) by inverse CDF with one counter-based
    uniform per row (uniform_from_seeds): the same seed gives the same token in any batch.
    Each row takes the cheapest path its parameters allow (see the two helpers above)."""
    logits = logits.float()
    greedy = temperature <= 0
    token_ids = logits.argmax(dim=-1)
    if bool(greedy.all()):
        return token_ids
    vocab = logits.shape[-1]
    filtered = ~greedy & (((top_k > 0) & (top_k < vocab)) | (top_p < 1.0) | (min_p > 0.0))
    plain = ~greedy & ~filtered
    u = uniform_from_seeds(seeds.to(logits.device))
    temp = torch.where(greedy, 1.0, temperature.float())[:, None]
    for rows_mask, path in ((plain, None), (filtered, True)):
        if not bool(rows_mask.any()):
            continue
        rows = None if bool(rows_mask.all()) else rows_mask.nonzero().squeeze(1)
        pick = (lambda t: t) if rows is None else (lambda t: t[rows])
        scaled = pick(logits) / pick(temp)
        if path is None:
            chosen = _sample_full_rows(scaled, pick(u))
        else:
            chosen = _sample_filtered_rows(scaled, pick(top_k), pick(top_p), pick(min_p),
                                           pick(u), candidates)
        if rows is None:
            token_ids = chosen
        else:
            token_ids[rows] = chosen
    return token_ids
