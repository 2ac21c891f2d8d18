"""CPU kernels in C++ (kernels/cpu/*.cpp), built once with torch's extension builder and
cached under ~/.cache/tritonserve/cpu_ops (TRITONSERVE_CACHE moves it). scripts/bootstrap.sh
builds them at install time, so a server start only loads the cached library.

`paged_decode_attention()` returns the op, or None when it cannot be had (no C++ compiler,
no ninja, a failed build, TRITONSERVE_CPU_OPS=0): callers then keep the plain-torch path.
The reason is logged once.

Why C++: the torch decode path gathers every sequence's K/V into new tensors (index_select),
then masks and runs SDPA, layer by layer; this op reads the cache in place through the block
table. Measured figures are in docs/benchmarks.md ("CPU paged decode attention").
"""
from __future__ import annotations

import functools
import logging
import os
import shutil
import sys
from pathlib import Path

import torch

from .cache import cache_root

log = logging.getLogger("kernels")

SOURCES = [Path(__file__).parent / "cpu" / name
           for name in ("paged_decode.cpp", "fused_ops.cpp", "linear.cpp", "linear_bf16.cpp",
                        "sampling.cpp", "decode_layers.cpp")]
HEADERS = [Path(__file__).parent / "cpu" / name  # staged beside them, not compiled
           for name in ("vec_math.h", "page_sweep.h", "paged_decode_bf16.h", "owned_panels.h",
                     "panels_bf16.h", "panels_amx.h", "panels_fp32.h", "rows.h",
                     "paged_decode_portable.h", "phase_clock.h")]
# -O3 with -march=native lets the compiler vectorise the head_dim loops for this CPU (AVX2 /
# AVX-512); the cache directory is per machine, so the native build is never shared.
# -fopenmp: at::parallel_for is inline OpenMP, serial without it (2x slower on 2 cores); the
# library then binds to the libgomp.so.1 torch has already loaded.
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp"]


def cache_dir() -> Path:
    return cache_root() / "cpu_ops"


def stage_sources(folder: Path) -> list[str]:
    """The sources copied into the cache (a file only when its contents changed): the build
    then names the same paths from every checkout, so a second checkout of the same code reuses
    the library instead of rebuilding it (ninja saw new paths: ~70 s here, measured). The
    headers are staged beside them, so ninja's dependency files see their changes; only the
    sources are returned (the build's list)."""
    staged = folder / "src"
    staged.mkdir(parents=True, exist_ok=True)
    paths = []
    for source in HEADERS + SOURCES:
        target = staged / source.name
        text = source.read_bytes()
        if not target.exists() or target.read_bytes() != text:
            target.write_bytes(text)
        if source in SOURCES:
            paths.append(str(target))
    return paths


@functools.cache
def load() -> bool:
    """Build (first time) and load the library; True when torch.ops.tritonserve has it."""
    if os.environ.get("TRITONSERVE_CPU_OPS", "1") == "0":
        log.info("CPU C++ ops disabled (TRITONSERVE_CPU_OPS=0): plain-torch attention")
        return False
    if shutil.which("c++") is None and shutil.which("g++") is None:
        log.warning("no C++ compiler: CPU decode attention stays on the plain-torch path")
        return False
    venv_bin = Path(sys.executable).parent  # pip's ninja, when the venv is not activated
    if shutil.which("ninja") is None and (venv_bin / "ninja").exists():
        os.environ["PATH"] = f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}"
    try:
        from torch.utils import cpp_extension
        folder = cache_dir()
        folder.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(name="tritonserve_cpu_ops", sources=stage_sources(folder),
                           extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
                           build_directory=str(folder),
                           is_python_module=False, verbose=False)
    except Exception as exc:  # a missing ninja, a compiler error: fall back, say why once
        log.warning("CPU C++ ops unavailable (%s): plain-torch attention",
                    str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__)
        return False
    _register_fake()
    return True


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


def main() -> int:
    """python -m kernels.cpu_ops: build now (scripts/bootstrap.sh calls this)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ok = load()
    print(f"CPU ops {'built in ' + str(cache_dir()) if ok else 'unavailable (see above)'}")
    return 0  # unavailable is not an install failure: the torch path serves


if __name__ == "__main__":
    raise SystemExit(main())

