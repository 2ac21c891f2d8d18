"""Kernel microbenchmarks: each Triton kernel against its torch reference (and decode
attention against SDPA on a contiguous cache; sampling against torch topk/sort + multinomial
and FlashInfer, bench/sampling_baselines.py), with triton.testing.do_bench medians on CUDA.

tritonserve bench kernels [--peak-gbps 4300] [--batch 64] [--context 4096] [--heads 32]
    [--kv-heads 8] [--head-dim 128] [--dtype bfloat16] [--block-size 16]
    [--sample-batch 128] [--vocab 128256] [--linear 4096,14336] [--json PATH]

The w4a16 / w8a16 rows: one K x N matmul at 1 row (GB/s of the packed weight against this
run's copy bandwidth) and at 64 rows (TFLOP/s against this run's dense matmul rate).

Without CUDA it times the torch paths only (smaller default shapes), and says so.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tritonserve.kernels import triton as kernels

from tritonserve.kernels import quant_layout, reference
from tritonserve.kernels.triton import fused_moe, quant_matmul
from tritonserve.kernels.triton._common import interpreting

from .sampling_baselines import sampling_rows


def timer(device: str):
    if device == "cuda":
        import triton.testing

        def run(fn):
            return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        return run

    def run_cpu(fn):
        fn()
        times = []
        for _ in range(5):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1000)
        return statistics.median(times)
    return run_cpu


def measure_ceilings(device: str, dtype: torch.dtype, measure) -> dict[str, float]:
    """This run's own floor and ceiling: copy bandwidth (bytes read + written) of a large
    tensor, and the dense matmul rate in the kernels' dtype."""
    n = (1 << 28) if device == "cuda" else (1 << 24)  # 512 MiB / 32 MiB of bf16-sized words
    src = torch.empty(n, device=device, dtype=torch.float16)
    dst = torch.empty_like(src)
    copy_ms = measure(lambda: dst.copy_(src))
    size = 8192 if device == "cuda" else 1024
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    mm_ms = measure(lambda: a @ b)
    return {"copy_GB/s": round(2 * src.numel() * 2 / copy_ms / 1e6, 1),
            "matmul_TFLOP/s": round(2 * size ** 3 / mm_ms / 1e9, 2)}


def paged_cache(args, device, dtype):
    blocks_per_seq = -(-args.context // args.block_size)
    num_blocks = args.batch * blocks_per_seq + 8
    shape = (num_blocks, args.block_size, args.kv_heads, args.head_dim)
    k_cache = torch.randn(shape, device=device, dtype=dtype)
    v_cache = torch.randn(shape, device=device, dtype=dtype)
    tables = torch.randperm(num_blocks, device=device)[:args.batch * blocks_per_seq]
    tables = tables.view(args.batch, blocks_per_seq).int()
    seq_lens = torch.full((args.batch,), args.context, dtype=torch.int32, device=device)
    return k_cache, v_cache, tables, seq_lens


def bench_all(args) -> list[dict]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    measure = timer(device)
    elem = torch.finfo(dtype).bits // 8
    rows = []
    triton_too = device == "cuda" or interpreting()
    ceilings = measure_ceilings(device, dtype, measure)
    peak_gbps = args.peak_gbps or ceilings["copy_GB/s"]

    def add(name, impl, ms, nbytes, flops=None):
        gbps = nbytes / ms / 1e6
        row = {"kernel": name, "impl": impl, "ms": round(ms, 4), "GB/s": round(gbps, 1),
               "peak_fraction": round(gbps / peak_gbps, 3)}
        if flops:
            row["TFLOP/s"] = round(flops / ms / 1e9, 2)
            row["flops_fraction"] = round(row["TFLOP/s"] / ceilings["matmul_TFLOP/s"], 3)
        rows.append(row)

    k_cache, v_cache, tables, seq_lens = paged_cache(args, device, dtype)
    q = torch.randn(args.batch, args.heads, args.head_dim, device=device, dtype=dtype)
    scale = args.head_dim ** -0.5
    kv_bytes = 2 * args.batch * args.context * args.kv_heads * args.head_dim * elem
    if triton_too:
        add("decode_attention", "triton", measure(lambda: kernels.paged_decode_attention(
            q, k_cache, v_cache, tables, seq_lens, scale, max_seq_len=args.context)),
            kv_bytes)
    add("decode_attention", "torch reference", measure(
        lambda: reference.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens,
                                                 scale)), kv_bytes)
    k_dense = torch.randn(args.batch, args.kv_heads, args.context, args.head_dim,
                          device=device, dtype=dtype)
    v_dense = torch.randn_like(k_dense)
    q_dense = q.view(args.batch, args.kv_heads, args.heads // args.kv_heads, args.head_dim)
    add("decode_attention", "SDPA, contiguous cache", measure(
        lambda: torch.nn.functional.scaled_dot_product_attention(q_dense, k_dense, v_dense)),
        kv_bytes)

    chunk = min(args.context, 1024)
    prefill_seqs = max(1, min(args.batch, 8))
    qp = torch.randn(prefill_seqs * chunk, args.heads, args.head_dim, device=device,
                     dtype=dtype)
    cu = torch.arange(0, prefill_seqs + 1, device=device, dtype=torch.int32) * chunk
    lens = seq_lens[:prefill_seqs]
    flops = 4 * prefill_seqs * args.heads * args.head_dim * (
        chunk * (args.context - chunk) + chunk * chunk / 2)
    pbytes = 2 * prefill_seqs * args.context * args.kv_heads * args.head_dim * elem
    if triton_too:
        add("prefill_attention", "triton", measure(lambda: kernels.paged_prefill_attention(
            qp, k_cache, v_cache, tables[:prefill_seqs], cu, lens, scale, max_q_len=chunk)),
            pbytes, flops)
    add("prefill_attention", "torch reference", measure(
        lambda: reference.paged_prefill_attention(qp, k_cache, v_cache, tables[:prefill_seqs],
                                                  cu, lens, scale)), pbytes, flops)

    tokens = args.batch * 16
    k_new = torch.randn(tokens, args.kv_heads, args.head_dim, device=device, dtype=dtype)
    slots = torch.randperm(k_cache.shape[0] * args.block_size, device=device)[:tokens]
    wbytes = 2 * 2 * tokens * args.kv_heads * args.head_dim * elem
    if triton_too:
        add("store_kv_cache", "triton", measure(lambda: kernels.store_kv_cache(
            k_new, k_new, k_cache, v_cache, slots)), wbytes)
    add("store_kv_cache", "torch reference", measure(lambda: reference.store_kv_cache(
        k_new, k_new, k_cache, v_cache, slots)), wbytes)

    sampling_rows(args.sample_batch, args.vocab, device, measure, add)
    quant_rows(args, device, dtype, measure, add, triton_too)
    moe_rows(args, device, dtype, measure, add, triton_too)
    return rows, ceilings


def packed_weight(kind: str, n: int, k: int, device: str) -> torch.Tensor:
    """A random packed weight (kernels/quant_layout.py) with sane fp16 scales: timing only."""
    record = quant_layout.RECORD_BYTES[kind]
    weight = torch.randint(0, 256, (-(-n // quant_layout.COLS), k // quant_layout.GROUP,
                                    record), dtype=torch.uint8, device=device)
    scales = 64 if kind == "u4" else 32
    weight[:, :, :scales] = torch.full((scales // 2,), 0.01, dtype=torch.float16,
                                       device=device).view(torch.uint8)
    return weight


def quant_rows(args, device, dtype, measure, add, triton_too) -> None:
    """w4a16 / w8a16 (kernels/triton/quant_matmul.py) on one matmul of --linear K,N at batch 1
    (share of the copy bandwidth: bytes read) and at 64 rows (share of the dense matmul
    rate), beside the dense matmul of the same shape in the kernels' dtype."""
    k, n = (int(v) for v in args.linear.split(","))
    dense = torch.randn(n, k, device=device, dtype=dtype)
    for rows in (1, 64):
        x = torch.randn(rows, k, device=device, dtype=dtype)
        flops = 2 * rows * n * k
        add(f"linear {rows}x{k}x{n}", f"dense {args.dtype}", measure(lambda: x @ dense.t()),
            dense.numel() * dense.element_size(), flops)
        if not triton_too:
            continue
        for kind in ("u4", "s8"):
            weight = packed_weight(kind, n, k, device)
            add(f"linear {rows}x{k}x{n}", f"triton {'w4a16' if kind == 'u4' else 'w8a16'}",
                measure(lambda: quant_matmul.quant_linear(x, weight, n)),
                weight.numel(), flops)


def moe_rows(args, device, dtype, measure, add, triton_too) -> None:
    """The fused MoE (kernels/triton/fused_moe.py) over --moe E,top_k,H,I experts at batch 1
    and 64, dense in the kernels' dtype and w4a16 (u4): share of the copy bandwidth over the
    bytes of the experts the batch chose (each read once), and at 64 rows of the matmul rate.
    The torch reference beside it (one matmul pair an expert)."""
    from tritonserve.engine.models.moe import route
    experts, top_k, hidden, inter = (int(v) for v in args.moe.split(","))
    gate_up = torch.randn(experts, 2 * inter, hidden, device=device, dtype=dtype) * 0.02
    down = torch.randn(experts, hidden, inter, device=device, dtype=dtype) * 0.02
    packed = (torch.stack([packed_weight("u4", 2 * inter, hidden, device)
                           for _ in range(experts)]),
              torch.stack([packed_weight("u4", hidden, inter, device) for _ in range(experts)]))
    for rows in (1, 64):
        x = torch.randn(rows, hidden, device=device, dtype=dtype)
        ids, weights = route(torch.randn(rows, experts, device=device), top_k, True)
        chosen = len(set(ids.flatten().tolist()))
        flops = 2 * rows * top_k * 3 * hidden * inter
        name = f"moe {rows}x{hidden} E{experts} top{top_k} I{inter}"
        dense_bytes = chosen * 3 * hidden * inter * gate_up.element_size()
        add(name, "torch reference", measure(lambda: reference.fused_moe(
            x, gate_up, down, ids, weights)), dense_bytes, flops)
        if not triton_too:
            continue
        add(name, f"triton {args.dtype}", measure(lambda: fused_moe.fused_moe(
            x, ids, weights, gate_up, down, inter)), dense_bytes, flops)
        add(name, "triton w4a16", measure(lambda: fused_moe.fused_moe(
            x, ids, weights, *packed, inter)),
            chosen * (packed[0][0].numel() + packed[1][0].numel()), flops)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tritonserve bench kernels")
    cuda = torch.cuda.is_available()
    p.add_argument("--peak-gbps", type=float, default=0.0,
                   help="bandwidth to compare against; 0 (default): this run's measured copy")
    p.add_argument("--batch", type=int, default=64 if cuda else 8)
    p.add_argument("--context", type=int, default=4096 if cuda else 512)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16" if cuda else "float32")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--sample-batch", type=int, default=128 if cuda else 16)
    p.add_argument("--vocab", type=int, default=128256 if cuda else 32000)
    p.add_argument("--linear", default="4096,14336" if cuda else "128,256",
                   help="K,N of the w4a16 / w8a16 matmul rows")
    p.add_argument("--moe", default="128,8,2048,768" if cuda else "8,2,64,32",
                   help="experts,top_k,hidden,intermediate of the fused MoE rows "
                        "(CUDA: Qwen3-30B-A3B's)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not cuda:
        from tritonserve.engine.cpu_allocator import keep_buffers_on_heap
        keep_buffers_on_heap()  # as the engine does on the CPU
        print("no CUDA device: CPU-sized shapes; the Triton rows run only when interpreted "
              "(TRITON_INTERPRET=1, a rehearsal: their times mean nothing)")
    rows, ceilings = bench_all(args)
    print(f"this run's ceilings: copy {ceilings['copy_GB/s']} GB/s, {args.dtype} matmul "
          f"{ceilings['matmul_TFLOP/s']} TFLOP/s (shares below are of these"
          + (f"; bandwidth share of --peak-gbps {args.peak_gbps:g})" if args.peak_gbps else ")"))
    print(f"{'kernel':<34}{'impl':<31}{'ms':>10}{'GB/s':>10}{'of peak':>9}")
    for r in rows:
        print(f"{r['kernel']:<34}{r['impl']:<31}{r['ms']:>10.4f}{r['GB/s']:>10.1f}"
              f"{r['peak_fraction']:>9.1%}"
              + (f"  {r['TFLOP/s']} TFLOP/s = {r['flops_fraction']:.1%} of matmul"
                 if "TFLOP/s" in r else ""))
    by_kernel: dict[str, dict[str, float]] = {}
    for r in rows:
        by_kernel.setdefault(r["kernel"], {})[r["impl"]] = r["ms"]
    for kernel, impls in by_kernel.items():
        ours = "triton" if "triton" in impls else "torch (ours)"
        if ours in impls and len(impls) > 1:
            others = {k: v / impls[ours] for k, v in impls.items() if k != ours}
            print(f"{kernel}: {ours} speed-up " + ", ".join(f"{v:.2f}x vs {k}"
                                                           for k, v in others.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if cuda else "cpu",
                       "args": vars(args), "ceilings": ceilings, "rows": rows}, f, indent=2)
    return 0
