"""Compile every kernel ahead of time for an NVIDIA target, with no GPU present.

python -m tritonserve.kernels.triton.compile_check [--arch 90]

Triton ships ptxas, so TTIR -> PTX -> cubin runs on any machine: this catches what the
interpreter cannot (dot shape limits, dtype rules, unsupported ops in compiled code). It
needs TRITON_INTERPRET unset or 0 when the kernels are imported (it sets that itself).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "0"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from .decode_attention import MAX_SPLITS, _decode_kernel, _merge_splits_kernel  # noqa: E402
from .fused_moe import _moe_gemm_kernel  # noqa: E402
from .kv_cache_write import _store_kv_int8_kernel, _store_kv_kernel  # noqa: E402
from .lora import (SGMV_BLOCK_M, _expand_kernel, _sgmv_expand_kernel,  # noqa: E402
                   _sgmv_shrink_kernel, _shrink_kernel)
from .prefill_attention import _prefill_kernel, tuning_space  # noqa: E402
from .quant_matmul import KINDS, _quant_matmul_kernel, block_shape, kernel_args  # noqa: E402
from .sampling import _BISECTION_STEPS, _ONE_BITS_PLUS_ONE, _sample_kernel  # noqa: E402

I32_ARGS = ("stride_qs", "stride_qh", "stride_bts", "stride_cb", "stride_ct", "stride_ch",
            "stride_os", "stride_oh", "stride_qt", "stride_ot", "stride_kt", "stride_vt",
            "stride", "B", "V", "M", "N", "K", "stride_xm", "stride_om", "valid",
            "stride_am", "stride_we", "stride_wn", "stride_wk", "expert_bytes",
            "R", "offset", "stride_x", "stride_a_slot", "stride_a_r", "stride_out",
            "stride_xa", "stride_b_slot", "stride_b_n", "stride_y")


def _signature(fn, pointers: dict[str, str], scalars: dict[str, str],
               constexprs: dict) -> dict[str, str]:
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
        elif name in scalars:
            signature[name] = scalars[name]
        elif name in I32_ARGS:
            signature[name] = "i32"
        else:
            raise KeyError(f"{fn.__name__}: no type for argument {name}")
    return signature


def variants():
    """(label, kernel, pointer types, scalar types, constexprs, options): every decode shape,
    every prefill autotuning config (tuning_space) and the sampler."""
    for dtype, fp32, precision in (("bf16", False, "tf32"), ("fp16", False, "tf32"),
                                   ("fp32", True, "ieee")):
        cache = {"q_ptr": f"*{dtype}", "k_cache_ptr": f"*{dtype}", "v_cache_ptr": f"*{dtype}",
                 "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "out_ptr": f"*{dtype}",
                 "cu_seqlens_q_ptr": "*i32", "part_acc_ptr": "*fp32", "part_max_ptr": "*fp32",
                 "part_sum_ptr": "*fp32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
                 "sinks_ptr": "*fp32"}
        masks = {"scale": "fp32", "window": "i32", "softcap": "fp32"}
        # the last shape also with a window, a soft-cap (Gemma 2 / 3) and sinks (gpt-oss)
        for splits, head_dim, group, block, masked in (
                (1, 128, 4, 16, False), (4, 128, 8, 32, False), (2, 96, 1, 16, False),
                (1, 64, 4, 32, False), (MAX_SPLITS, 128, 4, 16, False), (2, 256, 4, 16, True)):
            yield (f"decode {dtype} d{head_dim} g{group} bs{block} splits{splits}"
                   f"{' windowed softcapped' if masked else ''}",
                   _decode_kernel, cache, masks,
                   dict(NUM_KV_HEADS=8, GROUP=group, HEAD_DIM=head_dim,
                        BLOCK_G=max(16, triton.next_power_of_2(group)),
                        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=block,
                        TILE_N=max(block, 32 if fp32 else 64), NUM_SPLITS=splits, FP32=fp32,
                        PRECISION=precision, WINDOWED=masked, SOFTCAPPED=masked, INT8=False,
                        SINKS=masked), {})
        # every tuned config in bf16; fp16 is the same code with another element type, so one
        # config there (each 128-row variant costs ptxas 4-8 s: CI time)
        space = tuning_space(fp32) if dtype != "fp16" else tuning_space(fp32)[:1]
        prefill_shapes = [(4, 128, 16, config, False) for config in space]
        prefill_shapes += [(1, 64, 32, space[0], False), (3, 96, 16, space[0], False),
                           (8, 128, 16, space[-1], False), (4, 256, 16, space[0], True)]
        for group, head_dim, block, (rows, keys, warps, stages), masked in prefill_shapes:
            yield (f"prefill {dtype} g{group} d{head_dim} bs{block} m{rows} n{keys} "
                   f"w{warps} s{stages}{' windowed softcapped' if masked else ''}",
                   _prefill_kernel, cache, masks,
                   dict(GROUP=group, HEAD_DIM=head_dim,
                        BLOCK_G=triton.next_power_of_2(group),
                        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=block,
                        FP32=fp32, PRECISION=precision, BLOCK_M=rows, TILE_N=keys,
                        WINDOWED=masked, SOFTCAPPED=masked, INT8=False, SINKS=masked),
                   {"num_warps": warps, "num_stages": stages})
        for splits in (4, MAX_SPLITS):
            yield (f"merge splits{splits} -> {dtype}", _merge_splits_kernel, cache, {},
                   dict(NUM_HEADS=32, HEAD_DIM=128, BLOCK_D=128, NUM_SPLITS=splits,
                        SINKS=splits == MAX_SPLITS), {})
        yield (f"store_kv_cache {dtype}", _store_kv_kernel,
               {"k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}", "k_cache_ptr": f"*{dtype}",
                "v_cache_ptr": f"*{dtype}", "slot_ptr": "*i64"}, {},
               dict(ROW=1024, BLOCK=1024), {})
    # an int8 KV cache (--kv-cache-dtype int8) under bf16 queries: decode (split and not),
    # prefill (the fp32 tile: its K/V are fp32 once scaled) and the quantizing store
    int8_cache = {"q_ptr": "*bf16", "k_cache_ptr": "*i8", "v_cache_ptr": "*i8",
                  "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "block_tables_ptr": "*i32",
                  "seq_lens_ptr": "*i32", "out_ptr": "*bf16", "cu_seqlens_q_ptr": "*i32",
                  "part_acc_ptr": "*fp32", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32",
                  "sinks_ptr": "*fp32"}
    masks = {"scale": "fp32", "window": "i32", "softcap": "fp32"}
    for splits in (1, 4):
        yield (f"decode bf16 int8-cache d128 g4 bs16 splits{splits}", _decode_kernel,
               int8_cache, masks,
               dict(NUM_KV_HEADS=8, GROUP=4, HEAD_DIM=128, BLOCK_G=16, BLOCK_D=128,
                    BLOCK_SIZE=16, TILE_N=64, NUM_SPLITS=splits, FP32=True, PRECISION="tf32",
                    WINDOWED=False, SOFTCAPPED=False, INT8=True, SINKS=False), {})
    rows, keys, warps, stages = tuning_space(True)[0]
    yield ("prefill bf16 int8-cache g4 d128 bs16", _prefill_kernel, int8_cache, masks,
           dict(GROUP=4, HEAD_DIM=128, BLOCK_G=4, BLOCK_D=128, BLOCK_SIZE=16, FP32=True,
                PRECISION="tf32", BLOCK_M=rows, TILE_N=keys, WINDOWED=False, SOFTCAPPED=False,
                INT8=True, SINKS=False), {"num_warps": warps, "num_stages": stages})
    yield ("store_kv_cache bf16 -> int8", _store_kv_int8_kernel,
           {"k_ptr": "*bf16", "v_ptr": "*bf16", "k_cache_ptr": "*i8", "v_cache_ptr": "*i8",
            "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "slot_ptr": "*i64"}, {},
           dict(KV_HEADS=8, HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128), {})
    for dtype in ("bf16", "fp16"):  # w4a16 / w8a16 (s8h: Q6_K) at a decode batch and a wide one
        for kind in KINDS:
            for rows in (1, 64):
                block_m, block_n = block_shape(rows)
                yield (f"quant_matmul {kind} {dtype} m{block_m} n{block_n}",
                       _quant_matmul_kernel,
                       {"x_ptr": f"*{dtype}", "w8_ptr": "*i8", "w16_ptr": "*fp16",
                        "w32_ptr": "*i32", "bias_ptr": "*fp32", "out_ptr": f"*{dtype}"}, {},
                       dict(**kernel_args(kind), HAS_BIAS=rows == 1, BLOCK_M=block_m,
                            BLOCK_N=block_n, FP32=False, PRECISION="tf32"), {})
    for dtype in ("bf16", "fp16"):  # fused MoE: dense experts and w4a16 / w8a16 ones, the
        # gate/up launch (rows // top_k) and the down one (routing weights in the epilogue)
        for kind in ("dense", "u4", "s8"):
            for block_m, divisor, weighted in ((16, 8, False), (64, 1, True)):
                args = (dict(KIND=-1, RECORD=0, CODES_AT=0) if kind == "dense"
                        else kernel_args(kind))
                yield (f"fused_moe {kind} {dtype} m{block_m}{' weighted' if weighted else ''}",
                       _moe_gemm_kernel,
                       {"a_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "w8_ptr": "*i8",
                        "w16_ptr": "*fp16", "w32_ptr": "*i32",
                        "out_ptr": "*fp32" if weighted else f"*{dtype}", "rows_ptr": "*i64",
                        "tile_expert_ptr": "*i64", "weights_ptr": "*fp32",
                        "bias_ptr": "*fp32"},
                       # the down GEMM with gpt-oss's expert biases in its epilogue
                       {}, dict(**args, A_DIVISOR=divisor, MUL_WEIGHT=weighted, BIAS=weighted,
                                BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=32, FP32=False,
                                PRECISION="tf32"), {})
    for dtype in ("bf16", "fp16"):  # LoRA's shrink and expand (punica's BGMV shape)
        yield (f"lora_shrink {dtype}", _shrink_kernel,
               {"x_ptr": f"*{dtype}", "a_ptr": f"*{dtype}", "slot_ptr": "*i32",
                "out_ptr": "*fp32"}, {}, dict(BLOCK_R=16, BLOCK_K=64), {})
        yield (f"lora_expand {dtype}", _expand_kernel,
               {"xa_ptr": "*fp32", "b_ptr": f"*{dtype}", "slot_ptr": "*i32",
                "y_ptr": f"*{dtype}"}, {}, dict(BLOCK_N=64, BLOCK_R=16), {})
        # the segmented form (SGMV) for prefill runs: tl.dot on the adapter's dtype
        yield (f"sgmv_shrink {dtype}", _sgmv_shrink_kernel,
               {"x_ptr": f"*{dtype}", "a_ptr": f"*{dtype}", "tile_ptr": "*i32",
                "out_ptr": "*fp32"}, {},
               dict(BLOCK_M=SGMV_BLOCK_M, BLOCK_R=16, BLOCK_K=32, FP32=False,
                    PRECISION="tf32"), {})
        yield (f"sgmv_expand {dtype}", _sgmv_expand_kernel,
               {"xa_ptr": "*fp32", "b_ptr": f"*{dtype}", "tile_ptr": "*i32",
                "y_ptr": f"*{dtype}"}, {},
               dict(BLOCK_M=SGMV_BLOCK_M, BLOCK_N=64, BLOCK_R=16, FP32=False,
                    PRECISION="tf32"), {})
    for rows, block_v in ((1, 4096), (16, 1024)):
        yield (f"sample rows{rows} chunk{block_v}", _sample_kernel,
               {"logits_ptr": "*fp32", "temp_ptr": "*fp32", "top_k_ptr": "*i32",
                "top_p_ptr": "*fp32", "min_p_ptr": "*fp32", "seed_ptr": "*i64",
                "out_ptr": "*i64"}, {},
               dict(BLOCK_R=rows, BLOCK_V=block_v, STEPS=_BISECTION_STEPS,
                    ONE_PLUS=_ONE_BITS_PLUS_ONE), {})


def compile_all(arch: int = 90, warp_size: int = 32,
                report=lambda label, seconds: None) -> list[tuple[str, float]]:
    target = GPUTarget("cuda", arch, warp_size)
    done = []
    for label, fn, pointers, scalars, constexprs, options in variants():
        start = time.perf_counter()
        source = triton.compiler.ASTSource(
            fn=fn, signature=_signature(fn, pointers, scalars, constexprs),
            constexprs=constexprs)
        compiled = triton.compile(source, target=target, options=options)
        if not compiled.asm.get("cubin"):
            raise RuntimeError(f"{label}: no cubin produced")
        done.append((label, time.perf_counter() - start))
        report(*done[-1])
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tritonserve.kernels.triton.compile_check")
    parser.add_argument("--arch", type=int, default=90, help="sm_XX (90 = H100/H200)")
    args = parser.parse_args(argv)
    done = compile_all(args.arch, report=lambda label, seconds: print(
        f"ok  sm_{args.arch}  {label}  ({seconds:.1f} s)", flush=True))
    print(f"{len(done)} variants compiled")
    return 0


if __name__ == "__main__":
    sys.exit(main())
