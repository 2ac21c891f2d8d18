"""Plain-torch references for every kernel, with the same signatures.

They are the ground truth in the kernel tests and the engine's attention and sampling path on
the CPU, so they are written to be both obviously right and vectorised over the batch.
"""
from __future__ import annotations

import torch


# An int8 KV cache row (one token, one KV head): head_dim int8 codes, then the row's fp32
# scale as 4 bytes, so the caches stay one tensor each ([blocks, block_size, kv_heads,
# head_dim + 4]) and every path that moves blocks (the disk tier, tensor parallelism) moves
# the scales with them.
KV_SCALE_BYTES = 4


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] -> int8 rows [..., head_dim + 4]: symmetric, one scale a row
    (absmax / 127, so the largest value is exact), codes rounded to nearest."""
    scale = x.float().abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127.0
    codes = torch.round(x.float() / scale).clamp_(-127, 127).to(torch.int8)
    return torch.cat([codes, scale.view(torch.int8)], dim=-1)


def dequantize_kv(rows: torch.Tensor) -> torch.Tensor:
    """int8 cache rows [..., head_dim + 4] -> fp32 [..., head_dim]; any other dtype as is."""
    if rows.dtype != torch.int8:
        return rows
    scale = rows[..., -KV_SCALE_BYTES:].contiguous().view(torch.float32)
    return rows[..., :-KV_SCALE_BYTES].float() * scale


def store_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v [T, kv_heads, head_dim] into caches [blocks, block_size, kv_heads, head_dim] at
    slot = block * block_size + offset; slot -1 is padding and skipped. An int8 cache
    (head_dim + 4 a row) gets quantize_kv's rows."""
    slots = slot_mapping.long()
    if bool((slots < 0).any()):
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    write_kv_rows(k, v, k_cache, v_cache, slots)


def write_kv_rows(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """store_kv_cache without the padding check (every slot >= 0): traceable."""
    if k_cache.dtype == torch.int8:
        k, v = quantize_kv(k), quantize_kv(v)
    # index_copy_ rather than an indexed assignment: 3x faster on the CPU
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> None:
    """In place, x and residual [T, hidden]: residual += x, then x = weight * rms_norm(residual)
    with transformers' Llama numerics (fp32 statistics, rounded to the dtype before the weight)."""
    residual.add_(x)
    normed = torch.nn.functional.rms_norm(residual.float(), (x.shape[-1],), eps=eps)
    torch.mul(weight, normed.to(x.dtype), out=x)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2 * I] -> silu(x[:, :I]) * x[:, I:]  [T, I]"""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


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
    keys = dequantize_kv(k_cache.index_select(0, blocks)).view(batch, context, num_kv_heads,
                                                                 head_dim)
    values = dequantize_kv(v_cache.index_select(0, blocks)).view(batch, context, num_kv_heads,
                                                                   head_dim)
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


def _sequences(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor):
    """Each sequence with queries this step: (s, first query row, one past its last, length)."""
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        if cu[s + 1] > cu[s]:
            yield s, cu[s], cu[s + 1], seq_len


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float,
                            compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [total_q, heads, d]; sequence s's queries are its last (cu[s+1]-cu[s]) positions of
    seq_lens[s], causal; earlier positions (a cached prefix, earlier chunks) come from the cache.
    compute_dtype: the dtype SDPA runs in (fp32, the reference's; bf16 where a backend takes
    SDPA's own bf16 kernels, engine/attention.py)."""
    group, block_size = q.shape[1] // k_cache.shape[2], k_cache.shape[1]
    out = torch.empty_like(q)
    for s, q_start, q_end, seq_len in _sequences(cu_seqlens_q, seq_lens):
        q_len = q_end - q_start
        blocks = block_tables[s, :-(-seq_len // block_size)].long()
        keys = dequantize_kv(k_cache[blocks].flatten(0, 1)[:seq_len]).to(compute_dtype)
        values = dequantize_kv(v_cache[blocks].flatten(0, 1)[:seq_len]).to(compute_dtype)
        keys, values = keys.transpose(0, 1), values.transpose(0, 1)
        qs = q[q_start:q_end].to(compute_dtype).transpose(0, 1)  # [heads, q_len, d]
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


def paged_attention_masked(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, window: int | None = None,
                           softcap: float | None = None,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """paged_prefill_attention with a sliding window and a score soft-cap (Gemma 2 / 3,
    Mistral, Phi-3): query i of sequence s at position p sees the keys at positions
    (p - window, p] (window None: [0, p]); scores become softcap * tanh(s / softcap) before
    the softmax. Pages wholly before the window of the sequence's first query are not read.
    sinks [num_heads] (gpt-oss): each head's sink logit joins its softmax as one more score
    whose value is zero (transformers' eager_attention_forward for GptOss).
    A decode batch is this with one query a sequence (cu_seqlens_q = 0, 1, ..., B)."""
    group, block_size = q.shape[1] // k_cache.shape[2], k_cache.shape[1]
    out = torch.empty_like(q)
    for s, q_start, q_end, seq_len in _sequences(cu_seqlens_q, seq_lens):
        q_len = q_end - q_start
        first_pos = seq_len - q_len  # the first query's position
        first_block = max(0, first_pos - window + 1) // block_size if window else 0
        blocks = block_tables[s, first_block:-(-seq_len // block_size)].long()
        start = first_block * block_size  # the position of the first key read
        keys = dequantize_kv(k_cache[blocks].flatten(0, 1)[:seq_len - start]).float()
        values = dequantize_kv(v_cache[blocks].flatten(0, 1)[:seq_len - start]).float()
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, L, d]
        values = values.repeat_interleave(group, dim=1).transpose(0, 1)
        qs = q[q_start:q_end].float().transpose(0, 1)  # [heads, q_len, d]
        scores = qs @ keys.transpose(1, 2) * scale  # [heads, q_len, L]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(first_pos, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(start, seq_len, device=q.device)[None, :]
        visible = k_pos <= q_pos
        if window:
            visible &= k_pos > q_pos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink = sinks.float()[:, None, None].expand(-1, q_len, 1)
            probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        attn = probs @ values  # [heads, q_len, d]
        out[q_start:q_end] = attn.transpose(0, 1).to(q.dtype)
    return out


def _thresholds(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor) -> torch.Tensor:
    """Per-row probability threshold by a full sort: keep tokens with p >= threshold (ties
    kept). top-k, then top-p over the top-k mass, then min-p relative to the top probability.
    The definition the fast path below matches, and its fallback."""
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


_GAMMA = -0x61C8864680B583EB  # 0x9E3779B97F4A7C15 as int64: the next counter of a seed


def next_counter(seeds: torch.Tensor, n: int) -> torch.Tensor:
    """The n-th further counter of each seed (int64 arithmetic wraps)."""
    return seeds + torch.tensor(_GAMMA, dtype=torch.int64, device=seeds.device) * n


def uniform_from_seeds(seeds: torch.Tensor) -> torch.Tensor:
    """[B] int64 seeds -> [B] float64 uniforms in [0, 1): splitmix64's finaliser, a
    counter-based generator (the same seed gives the same number on any device, in any
    batch), computed for the whole batch in a few integer ops. int64 products wrap."""
    x = seeds.long() + 0x7F4A7C15
    x = (x ^ ((x >> 30) & 0x3FFFFFFFF)) * -0x40A7B892E31B1A47  # 0xBF58476D1CE4E5B9
    x = (x ^ ((x >> 27) & 0x1FFFFFFFFF)) * -0x6B2FB644ECCEEE15  # 0x94D049BB133111EB
    x = x ^ ((x >> 31) & 0x1FFFFFFFF)
    return ((x >> 11) & ((1 << 53) - 1)).double() * (1.0 / (1 << 53))


_CHUNK = 256


def draw(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """weights [R, V] >= 0 (not normalised), u [R] in [0, 1) -> [R] token drawn with
    probability weight / row total (inverse CDF). Two levels, so nothing [R, V]-sized is
    written: sums of 256-token chunks, a search among them, then a cumulative sum inside the
    chosen chunk only. A zero-weight token is never drawn."""
    rows, vocab = weights.shape
    if rows == 0:
        return torch.empty(0, dtype=torch.int64, device=weights.device)
    pad = (-vocab) % _CHUNK
    padded = torch.nn.functional.pad(weights, (0, pad)) if pad else weights
    chunks = padded.view(rows, -1, _CHUNK)  # [R, C, 256]
    cumulative = chunks.sum(dim=-1).double().cumsum(dim=-1)  # [R, C]
    target = u * cumulative[:, -1]
    chunk = torch.searchsorted(cumulative, target[:, None], right=True).squeeze(1)
    chunk = chunk.clamp(max=cumulative.shape[1] - 1)
    before = torch.where(chunk > 0, cumulative.gather(1, (chunk - 1).clamp(min=0)[:, None])
                         .squeeze(1), 0.0)
    inner = chunks[torch.arange(rows, device=weights.device), chunk].double().cumsum(dim=-1)
    # rounding between the two levels must not push the target past the chunk's last token
    rest = torch.minimum(target - before, torch.nextafter(inner[:, -1], torch.zeros_like(before)))
    offset = torch.searchsorted(inner, rest[:, None], right=True).squeeze(1)
    return chunk * _CHUNK + offset.clamp(max=_CHUNK - 1)


MAX_ATTEMPTS = 16  # top-p draws per row before the full-sort fallback


def _sample_rows(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """probs [R, V] softmax(logits / T) -> [R] tokens of the filtered distribution, with no
    sort of the vocabulary. top-k and min-p are thresholds (top-k's from torch.topk, only for
    the rows that ask); top-p by rejection: draw from the top-k / min-p set and keep the draw
    when the mass of the tokens more likely than it is below top_p x the top-k mass (exactly
    the rule of the sorted definition), else draw again with the seed's next counter. A draw
    is kept with probability >= top_p, so 0.95 needs 1.05 draws on average."""
    rows, vocab = probs.shape
    k = torch.where((top_k <= 0) | (top_k >= vocab), vocab, top_k).long()  # [R]
    threshold = min_p.float() * probs.amax(dim=-1)  # [R]
    mass_k = torch.ones(rows, dtype=probs.dtype, device=probs.device)
    if bool((k < vocab).any()):
        values = probs.topk(int(torch.where(k < vocab, k, 1).max()), dim=-1).values
        t_k = torch.where(k < vocab, values.gather(1, (k.clamp(max=values.shape[1]) - 1)
                                                   [:, None]).squeeze(1), 0.0)
        threshold = torch.maximum(threshold, t_k)
        mass_k = torch.where(k < vocab, torch.where(probs >= t_k[:, None], probs, 0.0)
                             .sum(dim=-1), 1.0)
    weights = probs
    if bool((threshold > 0).any()):
        weights = torch.where(probs >= threshold[:, None], probs, 0.0)
    tokens = draw(weights, uniform_from_seeds(seeds))
    pending = (top_p < 1.0).nonzero().squeeze(1)
    target = top_p.to(probs.dtype) * mass_k
    for attempt in range(1, MAX_ATTEMPTS + 1):
        if pending.numel() == 0:
            return tokens
        p = probs[pending]
        chosen = p.gather(1, tokens[pending][:, None])  # [P, 1]
        above = torch.where(p > chosen, p, 0.0).sum(dim=-1)  # mass of more likely tokens
        pending = pending[above >= target[pending]]
        if pending.numel() and attempt < MAX_ATTEMPTS:
            tokens[pending] = draw(weights[pending],
                                   uniform_from_seeds(next_counter(seeds[pending], attempt)))
    full = probs[pending]
    keep = full >= _thresholds(full, top_k[pending], top_p[pending], min_p[pending])[:, None]
    tokens[pending] = draw(torch.where(keep, full, 0.0),
                           uniform_from_seeds(next_counter(seeds[pending], MAX_ATTEMPTS)))
    return tokens


TOPK_CANDIDATES = 1024  # rows with 0 < top_k <= this sample among their topk candidates


def _sample_candidates(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                       top_p: torch.Tensor, min_p: torch.Tensor,
                       seeds: torch.Tensor) -> torch.Tensor:
    """Rows whose top_k is small: topk(k_max) gives the candidates already sorted, so top-p
    and min-p are exact on [R, k_max] (the sorted definition) and the vocabulary is read once,
    with no softmax over it."""
    values, ids = logits.topk(int(top_k.max()), dim=-1)  # [R, K], descending
    e = torch.exp((values - values[:, :1]) / temperature.float()[:, None])  # p / p_max
    rank = torch.arange(values.shape[1], device=logits.device)
    e = torch.where(rank[None, :] < top_k[:, None], e, 0.0)
    before = e.cumsum(dim=-1) - e  # mass of the more likely candidates
    keep = (before < top_p.float()[:, None] * e.sum(dim=-1, keepdim=True))
    keep &= e >= min_p.float()[:, None]
    chosen = draw(torch.where(keep, e, 0.0), uniform_from_seeds(seeds))
    return ids.gather(1, chosen[:, None]).squeeze(1)


def _sample_full(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor, min_p: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    if bool((temperature != 1.0).any()):
        logits = logits / temperature.float()[:, None]
    probs = torch.softmax(logits, dim=-1)  # [R, V]
    return _sample_rows(probs, top_k, top_p, min_p, seeds)


def _greedy(logits: torch.Tensor, *_: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
           top_p: torch.Tensor, min_p: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """logits [B, V]; per-row parameters [B]. Temperature 0 is an exact argmax. Otherwise a
    token is drawn from the filtered softmax(logits / T) by inverse CDF with counter-based
    uniforms (uniform_from_seeds): the same seed gives the same token in any batch. No sort
    of the vocabulary and no [B, V] of random numbers. Each row takes one of three paths, by
    its own parameters only (so a seeded row draws the same token in any batch): greedy;
    a small top_k -> its topk candidates (_sample_candidates); else softmax and a chunked
    search, with top-p by rejection (_sample_rows)."""
    logits = logits.float()
    vocab = logits.shape[1]
    seeds = seeds.to(logits.device)
    greedy = temperature <= 0
    few = ~greedy & (top_k > 0) & (top_k <= TOPK_CANDIDATES) & (top_k < vocab)
    paths = ((greedy, _greedy), (few, _sample_candidates), (~greedy & ~few, _sample_full))
    args = (temperature, top_k, top_p, min_p, seeds)
    for rows, path in paths:
        if bool(rows.all()):
            return path(logits, *args)
    tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    for rows, path in paths:
        index = rows.nonzero().squeeze(1)
        if index.numel():
            tokens[index] = path(logits[index], *(a[index] for a in args))
    return tokens


def swiglu_clamped(h: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU of h [T, 2I] (gate, then up): g = min(gate, limit),
    (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) [T, I] (transformers'
    GptOssExperts._apply_gate, over de-interleaved halves)."""
    gate, up = h.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * gate * torch.sigmoid(gate * alpha)


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
              weights: torch.Tensor, gate_up_bias: torch.Tensor | None = None,
              down_bias: torch.Tensor | None = None, swiglu_limit: float = 0.0,
              swiglu_alpha: float = 1.702) -> torch.Tensor:
    """x [T, H]; gate_up [E, 2I, H] (each expert's gate rows, then up rows), down [E, H, I];
    ids, weights [T, k] (each token's experts and their routing weights) -> [T, H] in x's
    dtype: sum_j weights[t, j] * down[e] @ (silu(gate[e] @ x[t]) * up[e] @ x[t]), e = ids[t, j].
    Each expert's product in x's dtype, as transformers computes it; the weighted sum in fp32,
    experts in index order. gpt-oss: biases [E, 2I] / [E, H] added to each expert's gate/up and
    down, and swiglu_limit > 0 takes swiglu_clamped for silu * up."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(ids).tolist():
        token, slot = torch.where(ids == e)
        h = x[token] @ gate_up[e].to(x.dtype).t()
        if gate_up_bias is not None:
            h = h + gate_up_bias[e].to(x.dtype)
        h = swiglu_clamped(h, swiglu_limit, swiglu_alpha) if swiglu_limit > 0 \
            else silu_and_mul(h)
        y = h @ down[e].to(x.dtype).t()
        if down_bias is not None:
            y = y + down_bias[e].to(x.dtype)
        out.index_add_(0, token, y.float() * weights[token, slot].float().unsqueeze(1))
    return out.to(x.dtype)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x [T, K], a [S, R, K], slots [T] (-1: no adapter) -> x @ a[slot].T per row, fp32 [T, R]
    (zeros where -1): kernels/triton/lora.py's contract."""
    out = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    rows = slots >= 0
    out[rows] = torch.einsum("tk,trk->tr", x[rows].float(), a[slots[rows].long()].float())
    return out


def lora_expand(y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                offset: int = 0) -> None:
    """y[t, offset:offset + N] += xa[t] @ b[slot[t]].T for rows with a slot, in place."""
    rows = slots >= 0
    n = b.shape[1]
    delta = torch.einsum("tr,tnr->tn", xa[rows], b[slots[rows].long()].float())
    y[rows, offset:offset + n] += delta.to(y.dtype)
