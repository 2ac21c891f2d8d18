"""tritonserve bench cpu-decode: the CPU decode attention alone, C++ op against the torch path.

SmolLM2's heads (9 query / 3 KV of 64) by default, one decode query per sequence over paged
K/V in a pool larger than the last-level cache. --layout scattered: pages at random over the
pool; engine: as the engine's allocator hands them out when every sequence prefills and then
decodes together (each sequence's --prompt-pages in turn, then the later pages interleaved
across the sequences). Between timed calls a buffer larger than the cache is read (--flush),
as the projections' weights are in the engine, so the op reads cold pages; the warm column
repeats the call without the flush (what the op's compute alone costs); the last two columns
are the same cold and warm for the schedule prefill rows take (`cached=True`). The machine's
own read bandwidth is measured in the same run: the op's GB/s is its share.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from tritonserve.engine.attention import bucketed_decode_attention
from tritonserve.kernels import cpu, reference


def _median_s(fn, calls: int, flush: torch.Tensor | None) -> float:
    times = []
    for _ in range(calls + 2):  # two warm-up calls
        if flush is not None:
            flush.sum()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def read_gbps(nbytes: int = 256 << 20) -> float:
    x = torch.ones(nbytes // 4)
    best = min(_median_s(x.sum, 1, None) for _ in range(5))
    return nbytes / best / 1e9


def core_to_core_ns() -> float | None:
    """A cache line's one-way trip between two of torch's threads (kernels/cpu
    machine_probe.cpp), ns; None without the C++ ops or with one thread. On a VM it says
    whether the two vCPUs share a CCD (~30 ns on Zen 4) or not (~160+): two placements with
    different read rates and sync costs (docs/benchmarks.md, "Two machines in one VM")."""
    from tritonserve.kernels import cpu
    probe = cpu.op("core_to_core_ns")
    if probe is None:
        return None
    ns = probe(20000)
    return None if ns != ns else ns  # NaN: fewer than two threads


def scattered_tables(pages: list[int], pool: int, gen: torch.Generator) -> torch.Tensor:
    """[B, max pages] block tables, every page at a random block of the pool."""
    perm = torch.randperm(pool, generator=gen)
    tables = torch.zeros(len(pages), max(pages), dtype=torch.int32)
    used = 0
    for row, n in enumerate(pages):
        tables[row, :n] = perm[used:used + n]
        used += n
    return tables


def engine_tables(pages: list[int], prompt_pages: int, pool: int,
                  gen: torch.Generator) -> torch.Tensor:
    """[B, max pages] block tables in the allocator's order for sequences admitted together:
    from a random start, each sequence's first prompt_pages blocks in turn, then page p of
    every sequence that has one, for p = prompt_pages, prompt_pages + 1, ..."""
    start = int(torch.randint(0, pool - sum(pages) + 1, (1,), generator=gen))
    order = [(row, p) for row, n in enumerate(pages) for p in range(min(n, prompt_pages))]
    order += [(row, p) for p in range(prompt_pages, max(pages))
              for row, n in enumerate(pages) if p < n]
    tables = torch.zeros(len(pages), max(pages), dtype=torch.int32)
    for block, (row, p) in enumerate(order, start):
        tables[row, p] = block
    return tables


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="tritonserve bench cpu-decode")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--input-range", default="50:400", help="MIN:MAX uniform context lengths")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--kv-dtype", default="auto", choices=["auto", "int8"],
                    help="int8: the cache as --kv-cache-dtype int8 rows (codes + scale)")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--flush-mb", type=int, default=128, help="0: no flush between calls")
    ap.add_argument("--pool-mb", type=int, default=512, help="K+V cache the pages scatter over")
    ap.add_argument("--layout", default="scattered", choices=["scattered", "engine"])
    ap.add_argument("--prompt-pages", type=int, default=4, help="engine layout: a prompt's pages")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    op = cpu.op("paged_decode_attention")
    if op is None:
        print("the C++ op is not available (see the log line): nothing to compare")
        return 1
    dtype = getattr(torch, args.dtype)
    int8 = args.kv_dtype == "int8"
    low, high = (int(x) for x in args.input_range.split(":"))
    gen = torch.Generator().manual_seed(args.seed)
    flush = torch.ones(args.flush_mb << 18) if args.flush_mb else None
    print(f"read bandwidth (this run): {read_gbps():.1f} GB/s; threads {torch.get_num_threads()}; "
          f"{args.dtype}, heads {args.heads}/{args.kv_heads} x {args.head_dim}, KV cache "
          f"{'int8' if int8 else args.dtype}")
    print(f"{'batch':>5} {'KV MB':>7} {'C++ op ms':>10} {'GB/s':>6} {'torch ms':>9} {'speed-up':>8} "
          f"{'warm ms':>8} {'cached':>7} {'warm':>7}")
    for batch in (int(b) for b in args.batches.split(",")):
        lens = torch.randint(low, high + 1, (batch,), generator=gen, dtype=torch.int32)
        pages = [-(-int(n) // args.block_size) for n in lens]
        row = (args.head_dim + reference.KV_SCALE_BYTES if int8 else
               args.head_dim * dtype.itemsize)  # bytes of one token's row of one KV head
        kv_bytes = int(lens.sum()) * args.kv_heads * row * 2
        pool = max(sum(pages) * 4,
                   (args.pool_mb << 20) // (args.block_size * args.kv_heads * row * 2))
        shape = (pool, args.block_size, args.kv_heads, args.head_dim)
        k_cache, v_cache = (torch.randn(shape, generator=gen).to(dtype) for _ in "kv")
        if int8:
            k_cache, v_cache = reference.quantize_kv(k_cache), reference.quantize_kv(v_cache)
        tables = (engine_tables(pages, args.prompt_pages, pool, gen) if args.layout == "engine"
                  else scattered_tables(pages, pool, gen))
        q = torch.randn(batch, args.heads, args.head_dim, generator=gen).to(dtype)  # [B, H, D]
        scale = args.head_dim ** -0.5
        op_s = _median_s(lambda: op(q, k_cache, v_cache, tables, lens, scale), args.calls, flush)
        torch_s = _median_s(lambda: bucketed_decode_attention(q, k_cache, v_cache, tables, lens,
                                                              scale), args.calls, flush)
        warm_s = _median_s(lambda: op(q, k_cache, v_cache, tables, lens, scale), args.calls,
                           None)
        # the schedule prefill rows take (cached=True), on cold and on cached pages
        cached_s, cached_warm_s = (_median_s(lambda: op(q, k_cache, v_cache, tables, lens, scale,
                                                        cached=True), args.calls, f)
                                   for f in (flush, None))
        print(f"{batch:>5} {kv_bytes / 1e6:>7.1f} {op_s * 1e3:>10.3f} "
              f"{kv_bytes / op_s / 1e9:>6.1f} {torch_s * 1e3:>9.3f} {torch_s / op_s:>7.2f}x "
              f"{warm_s * 1e3:>8.3f} {cached_s * 1e3:>7.3f} {cached_warm_s * 1e3:>7.3f}")
    return 0
