"""tritonserve bench cpu-linear [--dtype bfloat16]: a decoder's matmuls alone on the CPU, weights
cold, in each form engine/models/linear.py can hold them: C++ column panels, oneDNN-prepacked,
and the quantized panels (kernels/quant_layout.py): q4 (the layers in u4, the embedded GGUF's
Q4_1 form, the lm_head in s8 as its Q8_0) and q8 (s8 throughout), each with its own bytes.

SmolLM2-135M's shapes by default: 30 layers of qkv (960 x 576), o (576 x 576), gate/up
(3072 x 576) and down (576 x 1536), plus the tied lm_head (49152 x 576): 538 MB of fp32, read
once a pass like a decode step reads it (269 MB in bf16), so no weight is in cache when its
turn comes. The machine's read bandwidth, measured in the same run, is batch 1's floor.
"""
from __future__ import annotations

import argparse
import time

import torch

from tritonserve.engine.models import linear as lin
from tritonserve.kernels import quant_layout

from .cpu_decode import read_gbps


def _layer_shapes(args) -> list[tuple[int, int]]:
    h, i = args.hidden, args.intermediate
    q, kv = args.heads * args.head_dim, args.kv_heads * args.head_dim
    return [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)] * args.layers + [(args.vocab, h)]


def _pass_seconds(weights, forms, rows: int, repeats: int) -> float:
    """Best of `repeats` passes over every weight, each with a fresh [rows, K] input."""
    inputs = {k: torch.randn(rows, k).to(weights[0].dtype) for k in {w.shape[1] for w in weights}}
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for w, packed in zip(weights, forms):
            lin.linear(inputs[w.shape[1]], packed, out_features=w.shape[0])
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="tritonserve bench cpu-linear")
    ap.add_argument("--rows", default="1,4,16,64,256,2048", help="batch rows M, comma-separated")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--batch-hint", type=int, default=64, help="oneDNN's prepack batch")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    weights = [(torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
               for n, k in _layer_shapes(args)]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    flops_per_row = 2 * sum(w.numel() for w in weights)
    forms = {}
    if lin.has_form("panels", dtype):
        forms["panels (C++)"] = [lin.pack(w, "panels", 0) for w in weights]
    if lin.has_form("onednn", dtype):
        forms["oneDNN prepacked"] = [lin.pack(w, "onednn", args.batch_hint) for w in weights]
    if not forms:
        print("neither the C++ panels nor oneDNN are available here: nothing to compare")
        return 1
    if lin.has_form("quant", dtype) and all(k % 32 == 0 for _, k in _layer_shapes(args)):
        last = len(weights) - 1
        forms["q4 (u4 + s8 head)"] = [quant_layout.quantize(w, "s8" if i == last else "u4")
                                      for i, w in enumerate(weights)]
        forms["q8 (s8)"] = [quant_layout.quantize(w, "s8") for w in weights]
        forms["q6 (s8h: GGUF Q6_K)"] = [quant_layout.quantize(w, "s8h") for w in weights]
        # int4 codes repacked as they are: the bytes of a Q5_1 / Q5_K file or of mixed parts
        forms["q5 (s8hm: GGUF Q5_1, Q5_K)"] = [
            quant_layout.as_s8hm(quant_layout.quantize(w, "u4"), w.shape[0])
            for w in weights]
    read = read_gbps()
    print(f"weights {nbytes / 1e6:.0f} MB {args.dtype}; read bandwidth (this run) {read:.1f} GB/s, so "
          f"a pass reads them in >= {nbytes / read / 1e6:.1f} ms; threads "
          f"{torch.get_num_threads()}")
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            cells = []
            for name, packed in forms.items():
                seconds = _pass_seconds(weights, packed, rows, args.repeats)
                size = sum(p.numel() * p.element_size() for p in packed) if name.startswith(
                    "q") else nbytes
                cells.append(f"{name} {seconds * 1e3:.1f} ms ({size / 1e6:.0f} MB at "
                             f"{size / seconds / 1e9:.1f} GB/s, "
                             f"{rows * flops_per_row / seconds / 1e9:.0f} GFLOP/s)")
            print(f"M={rows}: " + "; ".join(cells))
    return 0
