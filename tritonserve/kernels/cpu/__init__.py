"""The C++ CPU library (kernels/cpu/*.cpp) as Python sees it: every op declared once in OPS
(name, fake, contract) and called through `op(name)`, None where the library cannot be had (no
C++ compiler, a failed build, a build this CPU cannot run, TRITONSERVE_CPU_OPS=0): callers then
keep the plain-torch path. Building, caching and the check against the running CPU:
kernels/cpu/build.py. scripts/bootstrap.sh builds the library at install time (`tritonserve
build-ops`), so a server start only loads it.

Why C++: the torch decode path gathers every sequence's K/V into new tensors (index_select),
then masks and runs SDPA, layer by layer; these ops read the cache in place through the block
table, and decode_layers runs a decode step's whole decoder stack in one parallel region.
Measured figures are in docs/benchmarks.md.
"""
from __future__ import annotations

import functools
import logging

import torch

from . import build

log = logging.getLogger("tritonserve.kernels")


# load()'s answer once it has run (a plain global a compiled graph may read: load itself
# builds and stats files, which torch.compile cannot trace)
LOADED = False


@functools.cache
def load() -> bool:
    """Build (first time) and load the library; True when torch.ops.tritonserve has it. Says
    in one log line what loaded, with its ISA levels, or why nothing did."""
    outcome = build.load()
    if not outcome.loaded:
        (log.info if "disabled" in outcome.reason else log.warning)(
            "CPU C++ ops unavailable: %s; the plain-torch paths serve", outcome.reason)
        return False
    _register_fakes()
    global LOADED
    LOADED = True
    (log.warning if outcome.note else log.info)("CPU C++ ops %s (%s)", outcome.reason,
                                                _describe_levels())
    return True


def isa_levels() -> tuple[str, ...]:
    """The ISA levels the loaded library was built with (kernels/cpu/isa.h: avx512,
    avx512_bf16, amx; () for the portable build or no library)."""
    return _levels() if load() else ()


def describe() -> str:
    """One phrase for logs and the model card: the library's levels, or 'unavailable'."""
    return _describe_levels() if load() else "unavailable"


def _levels() -> tuple[str, ...]:
    return tuple(level for level in torch.ops.tritonserve.isa_levels().split(",") if level)


def _describe_levels() -> str:
    return "ISA " + ("+".join(_levels()) or "portable (no AVX-512)")


def _fake(*shape_of):
    """A fake whose output has the shape `shape_of(args)` in the first argument's dtype."""
    return lambda *args, **kwargs: args[0].new_empty(shape_of[0](*args))


# Every C++ op Python calls, declared once: (name, fake or None, contract). The fake is the
# shape-only implementation torch.compile traces through (None: the op is never traced). The
# schemas are in the .cpp files' TORCH_LIBRARY_FRAGMENT blocks; `op(name)` is the op, or None
# where the library cannot be had.
OPS: tuple[tuple[str, object, str], ...] = (
    ("paged_decode_attention",
     lambda q, *args, **kwargs: torch.empty_like(q, memory_format=torch.contiguous_format),
     "(q, k_cache, v_cache, block_tables, seq_lens, scale, cached=False, window=0, "
     "softcap=0.0, sinks=None) -> out, the contract of reference.paged_decode_attention; "
     "cached=True: the "
     "pages were just written (prefill rows), the bf16 kernel takes the schedule faster on "
     "cached data (paged_decode_bf16.h); window > 0 / softcap > 0: those of "
     "reference.paged_attention_masked, pages before the window not read; sinks [H]: its "
     "sink logits (gpt-oss)"),
    ("add_rms_norm", lambda *args: None,
     "(x, residual, weight, eps): reference.add_rms_norm in place (fused_ops.cpp)"),
    ("silu_and_mul", _fake(lambda x: (x.shape[0], x.shape[1] // 2)),
     "(x [T, 2I]) -> silu(x[:, :I]) * x[:, I:] (fused_ops.cpp)"),
    ("rotary_embedding", _fake(lambda x, cos, sin: x.shape),
     "(x [T, heads, D], cos, sin [T, 1, D]) -> rotated x, contiguous (rotate-half, fp32 "
     "math rounded once)"),
    ("rope_store_kv",
     _fake(lambda qkv, cos, sin, slots, k_cache, v_cache, heads:
           (qkv.shape[0], heads, k_cache.shape[3])),
     "(qkv [T, (H + 2 Hk) D], cos, sin [T, 1, D], slot_mapping [T], k_cache, v_cache, "
     "num_heads) -> q [T, H, D] rotated; the rotated k and v written at their slots (-1: "
     "skipped)"),
    ("pack_linear_weight", _fake(lambda w: (-(-w.shape[0] // 16), w.shape[1], 16)),
     "(weight [N, K] fp32) -> panels for packed_linear (linear.cpp)"),
    ("packed_linear", _fake(lambda x, panels, n, bias: (x.shape[0], n)),
     "(x [M, K], panels, N, bias or None) -> x @ weight^T + bias, fp32"),
    ("pack_linear_weight_bf16",
     _fake(lambda w: (-(-w.shape[0] // 32), -(-w.shape[1] // 2), 32, 2)),
     "(weight [N, K] bf16) -> panels of k pairs for packed_linear_bf16 (linear_bf16.cpp)"),
    ("packed_linear_bf16", _fake(lambda x, panels, n, bias: (x.shape[0], n)),
     "(x [M, K] bf16, panels, N, bias or None) -> x @ weight^T + bias in bf16, fp32 sums"),
    ("packed_linear_silu_mul_bf16", _fake(lambda x, panels: (x.shape[0], panels.shape[0] * 16)),
     "(x [M, K] bf16, pack_gate_up_bf16 panels) -> silu(x @ gate^T) * (x @ up^T) [M, I]"),
    ("packed_linear_quant", _fake(lambda x, weight, n, bias: (x.shape[0], n)),
     "(x [M, K] fp32 or bf16, weight uint8 panels of kernels/quant_layout.py, N, bias or None) "
     "-> x @ dequantize(weight)^T + bias in x's dtype, the weight widened in registers "
     "(linear_quant.cpp)"),
    ("moe_experts", _fake(lambda x, *args: x.shape),
     "(x [T, H] fp32 or bf16, ids [T, k] int64, weights [T, k] fp32, gate_up [E, ...], "
     "down [E, ...], I, gate_up_bias=None, down_bias=None, swiglu_limit=0.0, swiglu_alpha="
     "1.702) -> reference.fused_moe's [T, H], each expert's weights in any form of "
     "engine/models/linear.py, the rows grouped by expert: an expert no row chose is not read "
     "(moe.cpp)"),
    ("decode_layers",
     lambda x, norms, panels, biases, cos, sin, slot_mapping, k_caches, v_caches, block_tables,
     seq_lens, num_heads, eps, scale, input_ids=None, positions=None, final_norm=None,
     lora_slots=None, lora_blobs=None, lora_index=None, gate_up_silu=True: (
         (x.new_empty(x.shape), x.new_empty(x.shape)) if input_ids is None else
         (x.new_empty(input_ids.shape[0], x.shape[1]),
          x.new_empty(input_ids.shape[0], x.shape[1]))),
     "a decode step's whole decoder stack in one parallel region (decode_layers.cpp), LoRA "
     "rows (lora_step.h); ask through decode_layers(dtype, ...), which checks this "
     "build runs the shapes"),
    ("sample_softmax",
     lambda logits, *args: logits.new_empty(logits.shape[0], dtype=torch.int64),
     "(logits [B, V] fp32, temperature [B] fp32, seeds [B] int64) -> tokens [B] int64: "
     "reference.sample for rows with no top-k, top-p or min-p (temperature 0: argmax), "
     "reading each row three times and writing nothing [B, V] (sampling.cpp)"),
    ("set_amx", None, "(on) -> whether bf16 panel matmuls run on AMX tiles now"),
    ("amx_enabled", None, "() -> whether bf16 panel matmuls of 4+ rows run on AMX tiles"),
    ("moe_bytes_read", None, "(reset) -> the expert weight bytes moe_experts gave its "
     "matmuls since the last reset (moe.cpp)"),
    ("decode_layers_supported", None, "(dtype, head_dim, group, block_size) -> bool"),
    ("decode_layers_timing", None, "(on): decode_layers' per-thread phase timing"),
    ("decode_layers_phases", None, "() -> (seconds [threads, phases, 2], calls)"),
    ("isa_levels", None, "() -> the build's ISA levels, comma-separated (isa.h)"),
    ("quant_kinds", None, "() -> int64 [kinds, 6]: id, code bits, record bytes, codes_at, "
     "scales a group, offset as this build reads each (kernels/quant_layout.py's KINDS)"),
    ("core_to_core_ns", None,
     "(trips) -> a cache line's one-way trip between two threads, ns (machine_probe.cpp)"),
)


def _register_fakes() -> None:
    for name, fake, _ in OPS:
        if fake is not None:
            torch.library.register_fake(f"tritonserve::{name}")(fake)


@functools.cache
def op(name: str):
    """torch.ops.tritonserve.<name>, one of OPS; None where the library cannot be had."""
    if name not in _NAMES:
        raise KeyError(f"{name!r} is not a C++ op of kernels/cpu (OPS)")
    return getattr(torch.ops.tritonserve, name) if load() else None


_NAMES = frozenset(name for name, _, _ in OPS)


_PANELS = {torch.float32: ("pack_linear_weight", "packed_linear"),
           torch.bfloat16: ("pack_linear_weight_bf16", "packed_linear_bf16")}


def panel_ops(dtype: torch.dtype):
    """(pack, product) of the panel matmul in this dtype (linear.cpp, linear_bf16.cpp): weight
    [N, K] -> panels; (x [M, K], panels, N, bias or None) -> x @ weight^T + bias. None where
    the dtype has no panels or the library is unavailable."""
    names = _PANELS.get(dtype)
    if names is None or not load():
        return None
    return op(names[0]), op(names[1])


def pack_gate_up_bf16(weight: torch.Tensor) -> torch.Tensor:
    """A fused gate/up weight [2I, K] bf16 (gate rows first), I a multiple of 16 -> panels for
    packed_linear_silu_mul_bf16: each panel's 32 columns are 16 gate rows and the same 16 up
    rows, so one panel's sums give 16 outputs of silu(gate) * up."""
    inter, k = weight.shape[0] // 2, weight.shape[1]
    if weight.shape[0] % 32 or weight.dtype != torch.bfloat16:
        raise ValueError("pack_gate_up_bf16: weight must be bf16 [2I, K] with I % 16 == 0")
    rows = weight.reshape(2, inter // 16, 16, k).transpose(0, 1).reshape(2 * inter, k)
    return op("pack_linear_weight_bf16")(rows.contiguous())


@functools.cache
def decode_layers(dtype: torch.dtype, head_dim: int, group: int, block_size: int):
    """The decode_layers op when this build runs it for the dtype and shapes: fp32 always,
    bf16 with AVX512-BF16 for head sizes 64 and 128, up to 8 query heads a KV head, pages of a
    multiple of 16 slots; else None."""
    if not load() or not op("decode_layers_supported")(dtype, head_dim, group, block_size):
        return None
    return op("decode_layers")


def set_amx(on: bool) -> bool:
    """Intel AMX tiles for every bf16 panel matmul (kernels/cpu/panels_amx.h) on or off, for
    the whole process (TRITONSERVE_AMX=0 starts them off); returns whether they are in use
    now: False where the CPU, the OS or the build has none."""
    return load() and bool(op("set_amx")(on))


def amx_enabled() -> bool:
    """Whether bf16 panel matmuls of 4 rows or more (K a multiple of 32) run on AMX tiles."""
    return load() and bool(op("amx_enabled")())


DECODE_PHASES = ("norm", "qkv", "attention", "o", "gate/up", "down")  # phase_clock.h's order


def decode_layers_timing(on: bool) -> bool:
    """Turn decode_layers' per-thread phase timing on (its totals reset) or off
    (kernels/cpu/phase_clock.h); False when the library is unavailable."""
    if not load():
        return False
    op("decode_layers_timing")(on)
    return True


def decode_layers_phases() -> tuple[torch.Tensor, int] | None:
    """decode_layers' phase totals since timing was turned on: seconds [threads,
    len(DECODE_PHASES), 2] (each thread's busy and barrier-wait time a phase) and the calls
    they cover; None when the library is unavailable."""
    return op("decode_layers_phases")() if load() else None


def main(argv: list[str] | None = None) -> int:
    """`tritonserve build-ops [--rebuild]`: build now (scripts/bootstrap.sh calls this);
    --rebuild retries a build that failed."""
    import argparse
    parser = argparse.ArgumentParser(prog="tritonserve build-ops")
    parser.add_argument("--rebuild", action="store_true", help="rebuild, even after a failure")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.rebuild:
        build.load(rebuild=True)  # load() then finds the fresh build
    print(f"CPU ops: {describe() if load() else 'unavailable (see above)'}")
    return 0  # unavailable is not an install failure: the torch path serves


if __name__ == "__main__":
    raise SystemExit(main())
