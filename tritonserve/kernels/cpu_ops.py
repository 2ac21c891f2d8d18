"""The C++ CPU ops (kernels/cpu/*.cpp) as Python sees them: one accessor per op, each None
where the library cannot be had (no C++ compiler, a failed build, a build this CPU cannot run,
TRITONSERVE_CPU_OPS=0): callers then keep the plain-torch path. Building, caching and the
check against the running CPU: kernels/cpu_build.py. scripts/bootstrap.sh builds the library at
install time (`tritonserve build-ops`), so a server start only loads it.

Why C++: the torch decode path gathers every sequence's K/V into new tensors (index_select),
then masks and runs SDPA, layer by layer; these ops read the cache in place through the block
table, and decode_layers runs a decode step's whole decoder stack in one parallel region.
Measured figures are in docs/benchmarks.md.
"""
from __future__ import annotations

import functools
import logging

import torch

from . import cpu_build

log = logging.getLogger("tritonserve.kernels")


@functools.cache
def load() -> bool:
    """Build (first time) and load the library; True when torch.ops.tritonserve has it. Says
    in one log line what loaded, with its ISA levels, or why nothing did."""
    outcome = cpu_build.load()
    if not outcome.loaded:
        (log.info if "disabled" in outcome.reason else log.warning)(
            "CPU C++ ops unavailable: %s; the plain-torch paths serve", outcome.reason)
        return False
    _register_fake()
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


def _register_fake() -> None:
    """Shape-only implementation, so torch.compile traces through the op."""
    @torch.library.register_fake("tritonserve::paged_decode_attention")
    def _(q, k_cache, v_cache, block_tables, seq_lens, scale, cached=False):
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.register_fake("tritonserve::add_rms_norm")
    def _(x, residual, weight, eps):
        return None

    @torch.library.register_fake("tritonserve::silu_and_mul")
    def _(x):
        return x.new_empty(x.shape[0], x.shape[1] // 2)

    @torch.library.register_fake("tritonserve::rotary_embedding")
    def _(x, cos, sin):
        return x.new_empty(x.shape)

    @torch.library.register_fake("tritonserve::rope_store_kv")
    def _(qkv, cos, sin, slot_mapping, k_cache, v_cache, num_heads):
        return qkv.new_empty(qkv.shape[0], num_heads, k_cache.shape[3])

    @torch.library.register_fake("tritonserve::pack_linear_weight")
    def _(weight):
        return weight.new_empty(-(-weight.shape[0] // 16), weight.shape[1], 16)

    @torch.library.register_fake("tritonserve::packed_linear")
    def _(x, panels, n, bias):
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake("tritonserve::pack_linear_weight_bf16")
    def _(weight):
        return weight.new_empty(-(-weight.shape[0] // 32), -(-weight.shape[1] // 2), 32, 2)

    @torch.library.register_fake("tritonserve::packed_linear_bf16")
    def _(x, panels, n, bias):
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake("tritonserve::packed_linear_silu_mul_bf16")
    def _(x, panels):
        return x.new_empty(x.shape[0], panels.shape[0] * 16)

    @torch.library.register_fake("tritonserve::decode_layers")
    def _(x, norms, panels, biases, cos, sin, slot_mapping, k_caches, v_caches, block_tables,
          seq_lens, num_heads, eps, scale):
        return x.new_empty(x.shape), x.new_empty(x.shape)

    @torch.library.register_fake("tritonserve::sample_softmax")
    def _(logits, temperature, seeds):
        return logits.new_empty(logits.shape[0], dtype=torch.int64)


def paged_decode_attention():
    """torch.ops.tritonserve.paged_decode_attention(q, k_cache, v_cache, block_tables,
    seq_lens, scale, cached=False) -> out, same contract as
    kernels.reference.paged_decode_attention; or None when the op is unavailable. cached=True
    says the pages were just written (prefill rows): the bf16 kernel then takes the schedule
    that is faster on cached data and slower on pages read from memory (paged_decode_bf16.h);
    the result is the same up to fp32 rounding."""
    return torch.ops.tritonserve.paged_decode_attention if load() else None


@functools.cache
def fused_ops():
    """(add_rms_norm, silu_and_mul) from kernels/cpu/fused_ops.cpp, same contracts as
    kernels.reference's; or None when the library is unavailable. Cached: the decoder asks
    twice a layer."""
    if not load():
        return None
    return torch.ops.tritonserve.add_rms_norm, torch.ops.tritonserve.silu_and_mul


@functools.cache
def rotary_embedding():
    """torch.ops.tritonserve.rotary_embedding(x [T, heads, D], cos, sin [T, 1, D]) -> rotated
    x, contiguous (rotate-half rope, fp32 math rounded once); or None when the library is
    unavailable."""
    return torch.ops.tritonserve.rotary_embedding if load() else None


@functools.cache
def rope_store_kv():
    """torch.ops.tritonserve.rope_store_kv(qkv [T, (H + 2 Hk) D], cos, sin [T, 1, D],
    slot_mapping [T] int64, k_cache, v_cache, num_heads) -> q [T, H, D]: q and k rotated as
    rotary_embedding does, the rotated k and v written at their slots (-1: skipped), q
    returned; or None when the library is unavailable."""
    return torch.ops.tritonserve.rope_store_kv if load() else None


@functools.cache
def packed_linear():
    """(pack_linear_weight, packed_linear) from kernels/cpu/linear.cpp: weight [N, K] fp32 ->
    panels; (x [M, K], panels, N, bias or None) -> x @ weight^T + bias. None when the library
    is unavailable."""
    if not load():
        return None
    return torch.ops.tritonserve.pack_linear_weight, torch.ops.tritonserve.packed_linear


@functools.cache
def packed_linear_bf16():
    """(pack_linear_weight_bf16, packed_linear_bf16) from kernels/cpu/linear_bf16.cpp: weight
    [N, K] bf16 -> panels of k pairs; (x [M, K] bf16, panels, N, bias or None) -> x @ weight^T
    + bias in bf16 (fp32 sums). None when the library is unavailable."""
    if not load():
        return None
    return torch.ops.tritonserve.pack_linear_weight_bf16, torch.ops.tritonserve.packed_linear_bf16


def set_amx(on: bool) -> bool:
    """Intel AMX tiles for every bf16 panel matmul (kernels/cpu/panels_amx.h) on or off, for
    the whole process (TRITONSERVE_AMX=0 starts them off); returns whether they are in use
    now: False where the CPU, the OS or the build has none."""
    return load() and bool(torch.ops.tritonserve.set_amx(on))


def amx_enabled() -> bool:
    """Whether bf16 panel matmuls of 4 rows or more (K a multiple of 32) run on AMX tiles."""
    return load() and bool(torch.ops.tritonserve.amx_enabled())


@functools.cache
def packed_linear_silu_mul_bf16():
    """(pack_gate_up_bf16, packed_linear_silu_mul_bf16): the MLP's gate/up matmul with
    silu(gate) * up in its epilogue, (x [M, K] bf16, panels) -> [M, I]; None when the library
    is unavailable."""
    if not load():
        return None
    return pack_gate_up_bf16, torch.ops.tritonserve.packed_linear_silu_mul_bf16


def pack_gate_up_bf16(weight: torch.Tensor) -> torch.Tensor:
    """A fused gate/up weight [2I, K] bf16 (gate rows first), I a multiple of 16 -> panels for
    packed_linear_silu_mul_bf16: each panel's 32 columns are 16 gate rows and the same 16 up
    rows, so one panel's sums give 16 outputs of silu(gate) * up."""
    inter, k = weight.shape[0] // 2, weight.shape[1]
    if weight.shape[0] % 32 or weight.dtype != torch.bfloat16:
        raise ValueError("pack_gate_up_bf16: weight must be bf16 [2I, K] with I % 16 == 0")
    rows = weight.reshape(2, inter // 16, 16, k).transpose(0, 1).reshape(2 * inter, k)
    return torch.ops.tritonserve.pack_linear_weight_bf16(rows.contiguous())


@functools.cache
def decode_layers(dtype: torch.dtype, head_dim: int, group: int, block_size: int):
    """torch.ops.tritonserve.decode_layers (kernels/cpu/decode_layers.cpp: a decode step's
    whole decoder stack in one parallel region) when this build runs it for the dtype and
    shapes: fp32 always, bf16 with AVX512-BF16 for head sizes 64 and 128, up to 8 query heads
    a KV head, pages of a multiple of 16 slots; else None."""
    if not load() or not torch.ops.tritonserve.decode_layers_supported(
            dtype, head_dim, group, block_size):
        return None
    return torch.ops.tritonserve.decode_layers


DECODE_PHASES = ("norm", "qkv", "attention", "o", "gate/up", "down")  # phase_clock.h's order


def decode_layers_timing(on: bool) -> bool:
    """Turn decode_layers' per-thread phase timing on (its totals reset) or off
    (kernels/cpu/phase_clock.h); False when the library is unavailable."""
    if not load():
        return False
    torch.ops.tritonserve.decode_layers_timing(on)
    return True


def decode_layers_phases() -> tuple[torch.Tensor, int] | None:
    """decode_layers' phase totals since timing was turned on: seconds [threads,
    len(DECODE_PHASES), 2] (each thread's busy and barrier-wait time a phase) and the calls
    they cover; None when the library is unavailable."""
    if not load():
        return None
    return torch.ops.tritonserve.decode_layers_phases()


def sample_softmax():
    """torch.ops.tritonserve.sample_softmax(logits [B, V] fp32, temperature [B] fp32, seeds
    [B] int64) -> tokens [B] int64 (kernels/cpu/sampling.cpp): kernels.reference.sample for
    rows with no top-k, top-p or min-p (temperature 0: argmax), reading each row three times
    and writing nothing [B, V]. None when the library is unavailable."""
    return torch.ops.tritonserve.sample_softmax if load() else None


def main(argv: list[str] | None = None) -> int:
    """`tritonserve build-ops [--rebuild]`: build now (scripts/bootstrap.sh calls this);
    --rebuild retries a build that failed."""
    import argparse
    parser = argparse.ArgumentParser(prog="tritonserve build-ops")
    parser.add_argument("--rebuild", action="store_true", help="rebuild, even after a failure")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.rebuild:
        cpu_build.load(rebuild=True)  # load() then finds the fresh build
    print(f"CPU ops: {describe() if load() else 'unavailable (see above)'}")
    return 0  # unavailable is not an install failure: the torch path serves


if __name__ == "__main__":
    raise SystemExit(main())

