"""One attention interface over the paged KV cache, with a torch and a Triton backend.

The batch is flattened to tokens, decode requests (one new token) first, then prefill
requests (a prompt, a chunk of it, or a recompute). The backend writes the new K/V into the
cache, then reads the cache for attention, so both paths see the same data.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from tritonserve.kernels import triton as kernels

from tritonserve.kernels import cpu, reference


@dataclass(frozen=True)
class AttentionMetadata:
    """One step's attention inputs, made by ModelRunner.prepare and never written after
    (a backend may keep what it derives from them for the step's other layers)."""
    slot_mapping: torch.Tensor  # [num_tokens] int64, block * block_size + offset
    num_decode_tokens: int | None  # None: every token (a dynamic compiled decode graph)
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32
    decode_seq_lens: torch.Tensor  # [num_decodes] int32, context length including the new token
    decode_max_seq_len: int  # known on the host: the kernels need no device read-back
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int32
    prefill_seq_lens: torch.Tensor  # [num_prefills] int32
    prefill_cu_seqlens_q: torch.Tensor  # [num_prefills + 1] int32
    prefill_max_q_len: int


class AttentionBackend:
    """Paged attention over caches `[num_blocks, block_size, num_kv_heads, head_dim]`;
    subclasses choose the kernels. Contract of the three steps (each also a registered op,
    below): store_kv writes row t of k/v at slot_mapping[t] (-1: skipped); decode attends one
    query per sequence to its first seq_lens[b] cached tokens; prefill attends the last
    (cu[s+1] - cu[s]) positions of sequence s causally to its first seq_lens[s] tokens.
    max_seq_len / max_q_len bound seq_lens / the query counts (host ints: no device read)."""

    name = "base"
    # a store that torch.compile may trace instead of calling the op, or None
    store_kv_traced = None
    # a decode the graph may call directly instead of the Python op (same signature as
    # decode, less max_seq_len), or None
    decode_traced = None
    # masked() runs kernels that take the window and soft-cap in every call: attend() then
    # sends every windowed layer there without reading the lengths on the host (which a
    # compiled graph could not), and a step inside its window pays only the kernels' check
    takes_masks = False

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        raise NotImplementedError

    def decode(self, q, k_cache, v_cache, block_tables, seq_lens, max_seq_len: int,
               scale: float) -> torch.Tensor:
        raise NotImplementedError

    def prefill(self, q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
                max_q_len: int, scale: float) -> torch.Tensor:
        raise NotImplementedError

    def rope_store(self, qkv: torch.Tensor, k_cache: torch.Tensor):
        """A fused rope + store for this qkv projection output, or None (the model then
        rotates q and k itself and calls forward): called as fn(qkv [T, (H + 2 Hk) D], cos,
        sin [T, 1, D], slot_mapping, k_cache, v_cache, num_heads) -> rotated q [T, H, D],
        having written the rotated k and v at their slots; attend() then reads them."""
        return None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, window: int | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, num_heads, head_dim], k/v [T, num_kv_heads, head_dim] -> [T, num_heads, head_dim]"""
        self.for_step().store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.attend(q, k_cache, v_cache, meta, scale, window, softcap, sinks)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float, window: int | None = None,
               softcap: float | None = None, sinks: torch.Tensor | None = None
               ) -> torch.Tensor:
        """forward after its store: q [T, num_heads, head_dim] against the caches, which
        already hold this step's K/V. window: the layer's sliding window (a query at p sees
        (p - window, p]), softcap: its score soft-cap, sinks: each head's sink logit [H]
        (gpt-oss); a step no key of which falls outside the window runs the plain kernels."""
        if softcap is not None or sinks is not None or (
                window is not None and (self.takes_masks or reaches_past(meta, window))):
            return self.masked(q, k_cache, v_cache, meta, scale, window, softcap, sinks)
        impl = self.for_step()
        return by_rows(
            q, meta,
            lambda rows: impl.decode(rows, k_cache, v_cache, meta.decode_block_tables,
                                     meta.decode_seq_lens, meta.decode_max_seq_len, scale),
            lambda rows: impl.prefill(rows, k_cache, v_cache, meta.prefill_block_tables,
                                      meta.prefill_cu_seqlens_q, meta.prefill_seq_lens,
                                      meta.prefill_max_q_len, scale))

    def masked(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
               window: int | None, softcap: float | None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """attend with a window, soft-cap or sinks: the decode rows and the prefill rows each
        through kernels/reference.py's paged_attention_masked (which skips the pages before
        the window), unless the backend has kernels that take them."""
        return by_rows(
            q, meta,
            lambda rows: reference.paged_attention_masked(
                rows, k_cache, v_cache, meta.decode_block_tables,
                torch.arange(rows.shape[0] + 1, dtype=torch.int32, device=q.device),
                meta.decode_seq_lens, scale, window, softcap, sinks),
            lambda rows: reference.paged_attention_masked(
                rows, k_cache, v_cache, meta.prefill_block_tables, meta.prefill_cu_seqlens_q,
                meta.prefill_seq_lens, scale, window, softcap, sinks))

    def for_step(self) -> AttentionBackend:
        """Itself, eager (a registered op costs 8-20 us more a call, measured); while
        torch.compile traces, the same backend through the registered ops below, which the
        graph keeps as opaque calls."""
        return ThroughOps(self) if torch.compiler.is_compiling() else self


def by_rows(q: torch.Tensor, meta: AttentionMetadata, decode, prefill) -> torch.Tensor:
    """decode(rows) over the step's decode rows (the first num_decode_tokens; None: all) and
    prefill(rows) over the rest, in row order."""
    nd = q.shape[0] if meta.num_decode_tokens is None else meta.num_decode_tokens
    outputs = []
    if nd:
        outputs.append(decode(q[:nd]))
    if nd < q.shape[0]:
        outputs.append(prefill(q[nd:]))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def reaches_past(meta: AttentionMetadata, window: int) -> bool:
    """Some query of the step has keys outside `window` (the host knows the decode rows'
    longest context; the prefill rows' lengths are read, once a windowed layer asks)."""
    if meta.decode_max_seq_len > window:
        return True
    lens = meta.prefill_seq_lens
    return lens.numel() > 0 and int(lens.max()) > window


class ThroughOps(AttentionBackend):
    """A backend as a compiled graph calls it: each step through its registered op, or the
    store / decode the backend lets the graph trace or call directly."""

    def __init__(self, inner: AttentionBackend) -> None:
        self.inner = inner

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        if self.inner.store_kv_traced is not None:
            return self.inner.store_kv_traced(k, v, k_cache, v_cache, slot_mapping)
        torch.ops.tritonserve.store_kv(k, v, k_cache, v_cache, slot_mapping,
                                       backend=self.inner.name)

    def decode(self, q, k_cache, v_cache, block_tables, seq_lens, max_seq_len, scale):
        if self.inner.decode_traced is not None:
            return self.inner.decode_traced(q, k_cache, v_cache, block_tables, seq_lens, scale)
        return torch.ops.tritonserve.decode_attention(q, k_cache, v_cache, block_tables,
                                                      seq_lens, max_seq_len, scale,
                                                      backend=self.inner.name)

    def prefill(self, q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, max_q_len,
                scale):
        return torch.ops.tritonserve.prefill_attention(q, k_cache, v_cache, block_tables,
                                                       cu_seqlens_q, seq_lens, max_q_len,
                                                       scale, backend=self.inner.name)


# CPU prefill chunks of up to this many query rows run as decode rows of the C++ op, each
# over its own first position + 1 tokens (CpuAttention.prefill), instead of a gather and
# SDPA per sequence. SmolLM2, ~4,000 prompt tokens a run, bf16 / fp32: 64
# prompts of 64 tokens 1.265 -> 1.124 s / 3.88 -> 3.87 s, 8 of 512 1.79 -> 1.39 s / 4.02 ->
# 3.92, 2 of 2,000 3.50 -> 2.50 s / 6.32 -> 6.11; longer chunks are unmeasured, so SDPA.
PREFILL_AS_DECODE_MAX = 2048

# fp32 and bf16 prefill chunks whose sequences average at least this many tokens of context
# run SDPA (gather + its GEMMs, in the chunk's dtype: TorchAttention.prefill) instead. fp32,
# one layer, SmolLM2 heads, 2-core AVX2 EPYC, rows -> SDPA: 1 x 1024 tokens 38.2 -> 23.5 ms,
# 2 x 1024 72.6 -> 37.8, 8 x 512 86.7 -> 67.7, 2,048 rows over 8,192 801 -> 401, 256 rows
# over 4,096 66.7 -> 30.5, 1 x 256 2.6 -> 2.1; short sequences keep the rows (32 x 64: 8.1
# against 16.6, SDPA's loop per sequence). bf16, the embedded model's whole prefill, 2-core
# Xeon with AMX, rows -> bf16 SDPA: 256 tokens 0.09 -> 0.09 s, 1,024 0.50 -> 0.33, 2,000 1.49
# -> 0.76, 4,000 6.05 -> 2.48, 8,000 34.7 -> 8.2 (SDPA in fp32 there: 19.4 s).
PREFILL_SDPA_CONTEXT = 256

MAX_BUCKETS = 4  # 1: 306 ms, 4: 228 ms, 8: 240 ms per batch-64 SmolLM2 step, 50-400 tokens


def bucketed_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, seq_lens: torch.Tensor,
                              scale: float) -> torch.Tensor:
    """The torch decode path pads every sequence to the longest in its call, so a batch of
    mixed lengths is sorted by length and attended in up to 4 equal-count buckets: with
    lengths spread over 50-400 this reads a third less padding (measured on SmolLM2)."""
    num_buckets = min(MAX_BUCKETS, q.shape[0] // 8)
    if num_buckets <= 1:
        return reference.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens,
                                                scale)
    out = torch.empty_like(q)
    for rows in torch.argsort(seq_lens).tensor_split(num_buckets):
        out.index_copy_(0, rows, reference.paged_decode_attention(
            q[rows], k_cache, v_cache, block_tables[rows], seq_lens[rows], scale))
    return out


class TorchAttention(AttentionBackend):
    """Plain torch: gather + SDPA, the path where nothing else runs."""

    name = "torch"

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        reference.store_kv_cache(k, v, k_cache, v_cache, slot_mapping)

    @staticmethod
    def store_kv_traced(k, v, k_cache, v_cache, slot_mapping) -> None:
        """The compiled decode's store: its padding rows write the null block, never slot -1,
        so the host check goes and the scatter is traced into the graph. Through the op it cost
        0.26 ms a call (batch 1, 60 calls a step); traced, the compiled batch-1 SmolLM2 step
        went from 89.8 to 78.7 ms."""
        reference.write_kv_rows(k, v, k_cache, v_cache, slot_mapping)

    def decode(self, q, k_cache, v_cache, block_tables, seq_lens, max_seq_len, scale):
        return bucketed_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)

    def prefill(self, q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, max_q_len,
                scale):
        """SDPA in bf16 for bf16 chunks (its own bf16 kernels: 114 ms against fp32's 257 for
        a 2,048-row chunk over 8,192 tokens, 2-core Xeon with AMX), else in fp32."""
        return reference.paged_prefill_attention(
            q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale,
            compute_dtype=torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32)


class CpuAttention(TorchAttention):
    """The torch backend with the C++ ops (kernels/cpu/paged_decode.cpp) that read the cache
    in place: 2-3x faster decode than gathering (docs/perf-log/2026-cpu-decode.md), prefill
    chunks as decode rows, and in bf16 / fp16 rope + store in one op. For a plan whose
    attention is cpu (the library loaded)."""

    name = "cpu"

    def __init__(self) -> None:
        self.cpu_decode = cpu.op("paged_decode_attention")
        # compiled: the graph calls the C++ op itself (a registered op with a fake), not the
        # Python tritonserve::decode_attention around it: 83 instead of 147 us a call
        # (batch 1, SmolLM2), 2 ms of a 44 ms step
        self.decode_traced = self.cpu_decode
        self.cpu_rope_store = cpu.op("rope_store_kv")
        self._rows = None  # the last prefill's (inputs, rows): _rows_of
        self.takes_masks = self.cpu_decode is not None

    def rope_store(self, qkv, k_cache):
        """bf16 / fp16: the C++ op (fp32 math rounded once, as rotary_embedding); fp32 keeps
        torch's op-by-op rope, which the greedy parity with transformers is token-identical
        to; an int8 cache takes reference.quantize_kv's store."""
        if self.cpu_rope_store is None or qkv.dtype not in (torch.bfloat16, torch.float16) \
                or k_cache.dtype != qkv.dtype:
            return None
        return self.cpu_rope_store

    def decode(self, q, k_cache, v_cache, block_tables, seq_lens, max_seq_len, scale):
        if self.cpu_decode is None:
            return super().decode(q, k_cache, v_cache, block_tables, seq_lens, max_seq_len,
                                  scale)
        return self.cpu_decode(q, k_cache, v_cache, block_tables, seq_lens, scale)

    def prefill(self, q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, max_q_len,
                scale):
        if self.cpu_decode is None or max_q_len > PREFILL_AS_DECODE_MAX or (
                q.dtype in (torch.float32, torch.bfloat16)
                and int(seq_lens.sum()) >= PREFILL_SDPA_CONTEXT * len(seq_lens)):
            return super().prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
                                   max_q_len, scale)
        tables, lens = self._rows_of(block_tables, cu_seqlens_q, seq_lens)
        return self.cpu_decode(q, k_cache, v_cache, tables, lens, scale, cached=True)

    def masked(self, q, k_cache, v_cache, meta, scale, window, softcap, sinks=None):
        """The C++ op takes the window, the soft-cap and the sinks (its portable kernel, which
        reads no page before the window): decode rows, and prefill chunks as decode rows."""
        nd = q.shape[0] if meta.num_decode_tokens is None else meta.num_decode_tokens
        if self.cpu_decode is None or (nd < q.shape[0]
                                       and meta.prefill_max_q_len > PREFILL_AS_DECODE_MAX):
            return super().masked(q, k_cache, v_cache, meta, scale, window, softcap, sinks)
        masks = (window or 0, softcap or 0.0, sinks)

        def prefill(rows):
            tables, lens = self._rows_of(meta.prefill_block_tables, meta.prefill_cu_seqlens_q,
                                         meta.prefill_seq_lens)
            return self.cpu_decode(rows, k_cache, v_cache, tables, lens, scale, True, *masks)

        return by_rows(q, meta, lambda rows: self.cpu_decode(
            rows, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, scale,
            False, *masks), prefill)

    def _rows_of(self, block_tables, cu_seqlens_q, seq_lens):
        """Every query row as a decode row over its first position + 1 tokens: its block
        table and length. Every layer of a step asks with the same tensors (AttentionMetadata
        is never written once made), so the rows are made once a step: 30 layers x 51 us =
        1.5 ms of SmolLM2's 45 ms 64-token prefill."""
        key = (block_tables, cu_seqlens_q, seq_lens)
        if self._rows is not None and all(a is b for a, b in zip(key, self._rows[0])):
            return self._rows[1]
        q_lens = cu_seqlens_q.diff().long()  # [S]
        seq_of_row = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens)  # [T]
        offset = torch.arange(len(seq_of_row)) - cu_seqlens_q[:-1].long()[seq_of_row]
        lens = seq_lens.long()[seq_of_row] - q_lens[seq_of_row] + offset + 1  # [T]
        rows = (block_tables[seq_of_row], lens.to(torch.int32))
        self._rows = (key, rows)
        return rows


class TritonAttention(AttentionBackend):
    name = "triton"
    takes_masks = True

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        kernels.store_kv_cache(k, v, k_cache, v_cache, slot_mapping)

    def decode(self, q, k_cache, v_cache, block_tables, seq_lens, max_seq_len, scale):
        return kernels.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens,
                                              scale, max_seq_len=max_seq_len)

    def prefill(self, q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, max_q_len,
                scale):
        return kernels.paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q,
                                               seq_lens, scale, max_q_len=max_q_len)

    def masked(self, q, k_cache, v_cache, meta, scale, window, softcap, sinks=None):
        """The kernels take the window, the soft-cap and the sinks themselves."""
        return by_rows(
            q, meta,
            lambda rows: kernels.paged_decode_attention(
                rows, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, scale,
                max_seq_len=meta.decode_max_seq_len, window=window, softcap=softcap,
                sinks=sinks),
            lambda rows: kernels.paged_prefill_attention(
                rows, k_cache, v_cache, meta.prefill_block_tables, meta.prefill_cu_seqlens_q,
                meta.prefill_seq_lens, scale, max_q_len=meta.prefill_max_q_len, window=window,
                softcap=softcap, sinks=sinks))


BACKENDS = {"triton": TritonAttention, "cpu": CpuAttention, "torch": TorchAttention}


def make_attention_backend(name: str) -> AttentionBackend:
    """The backend a decode plan's attention names (engine/plan.py)."""
    return BACKENDS[name]()


# ---- the registered ops: what a compiled graph calls (ThroughOps) ----------------------------
_op_backend = functools.cache(make_attention_backend)  # one per name for the ops below


@torch.library.custom_op("tritonserve::store_kv", mutates_args=("k_cache", "v_cache"))
def _store_kv_op(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor, backend: str) -> None:
    _op_backend(backend).store_kv(k, v, k_cache, v_cache, slot_mapping)


@torch.library.custom_op("tritonserve::decode_attention", mutates_args=())
def _decode_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
               scale: float, backend: str) -> torch.Tensor:
    return _op_backend(backend).decode(q, k_cache, v_cache, block_tables, seq_lens,
                                                   max_seq_len, scale)


@_decode_op.register_fake
def _(q, k_cache, v_cache, block_tables, seq_lens, max_seq_len, scale, backend):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.custom_op("tritonserve::prefill_attention", mutates_args=())
def _prefill_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                max_q_len: int, scale: float, backend: str) -> torch.Tensor:
    return _op_backend(backend).prefill(q, k_cache, v_cache, block_tables,
                                                    cu_seqlens_q, seq_lens, max_q_len, scale)


@_prefill_op.register_fake
def _(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, max_q_len, scale, backend):
    return torch.empty_like(q, memory_format=torch.contiguous_format)
