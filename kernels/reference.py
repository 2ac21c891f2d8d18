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


def _thresholds(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor) -> torch.Tensor:
    """Per-row probability threshold: keep tokens with p >= threshold (ties kept).
    top-k, then top-p over the top-k mass, then min-p relative to the top probability."""
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


def exponential_noise(seeds: torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:
    """Exp(1) noise [B, V], one independent stream per row seed."""
    rows = []
    for seed in seeds.tolist():
        generator = torch.Generator().manual_seed(int(seed))
        rows.append(torch.empty(vocab).exponential_(generator=generator))
    return torch.stack(rows).to(device)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
           top_p: torch.Tensor, min_p: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """logits [B, V]; per-row parameters [B]. Temperature 0 is an exact argmax. Otherwise a
    token is drawn from the filtered softmax(logits / T) as argmax(p / E), E ~ Exp(1) seeded
    per row (the exponential race, equivalent to sampling from p)."""
    logits = logits.float()
    greedy = temperature <= 0
    token_ids = logits.argmax(dim=-1)
    if bool(greedy.all()):
        return token_ids
    temp = torch.where(greedy, 1.0, temperature.float())
    probs = torch.softmax(logits / temp[:, None], dim=-1)
    keep = probs >= _thresholds(probs, top_k, top_p, min_p)[:, None]
    noise = exponential_noise(seeds, logits.shape[-1], logits.device)
    race = torch.where(keep, probs / noise, -1.0)
    return torch.where(greedy, token_ids, race.argmax(dim=-1))
