"""Builds the C++ CPU library (kernels/cpu/*.cpp) and loads it only where this CPU runs it.

A build lives in its own folder under ~/.cache/tritonserve/cpu_ops (TRITONSERVE_CACHE moves
it), named by a hash of what decides its machine code: the target's ISA features (the
compiler's own macros for -march, so `native` on two machines differs), the compiler and its
version, the flags, torch's version and the sources. Beside the library a manifest lists the
CPU features the build may use; before loading, each is checked against the running CPU
(/proc/cpuinfo), so a cache folder shared or copied between machines (an NFS home, a container
image) never loads AVX-512 code on a CPU without it: that was a SIGILL at the first decode step
with no traceback. A build that failed leaves build-failed.txt with the compiler's output and is
not retried at each start (a change of sources, compiler or torch makes a new folder; deleting
the file, or `tritonserve build-ops --rebuild`, retries it).

Knobs: TRITONSERVE_CPU_OPS=0 (never build or load), TRITONSERVE_CPU_MARCH (the -march, default
native: x86-64-v3 builds the AVX2 library, as tests/test_cpu_build.py does), CXX (the compiler,
as torch's extension builder reads it), TRITONSERVE_CPU_FLAGS (the running CPU's flags, space-
separated, in place of /proc/cpuinfo: a test's way to play another CPU).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from tritonserve.cache import cache_root

log = logging.getLogger("tritonserve.kernels")

FOLDER = Path(__file__).parent
SOURCES = [FOLDER / name for name in ("paged_decode.cpp", "fused_ops.cpp", "linear.cpp",
                                      "linear_bf16.cpp", "linear_quant.cpp", "sampling.cpp",
                                      "decode_layers.cpp", "machine_probe.cpp", "moe.cpp")]
HEADERS = sorted(FOLDER.glob("*.h"))  # staged beside them, not compiled
NAME = "tritonserve_cpu_ops"
FAILED = "build-failed.txt"
MANIFEST = "manifest.json"
KEEP_BUILDS = 4  # older builds for the same target are removed after a new one succeeds

# -O3 with -march lets the compiler vectorise the head_dim loops for the target (AVX2 /
# AVX-512). -fopenmp: at::parallel_for is inline OpenMP, serial without it (2x slower on 2
# cores); the library then binds to the libgomp.so.1 torch has already loaded.
BASE_CFLAGS = ["-O3", "-ffast-math", "-fno-finite-math-only", "-fopenmp"]

# The compiler's target macros -> the /proc/cpuinfo flag the instructions need. Every ISA
# extension GCC or clang may emit for an x86 -march is here, not only those isa.h names: with
# -march=native the compiler vectorises plain loops with whatever the target has.
MACRO_FLAGS = {
    "__SSE3__": "pni", "__SSSE3__": "ssse3", "__SSE4_1__": "sse4_1", "__SSE4_2__": "sse4_2",
    "__POPCNT__": "popcnt", "__AVX__": "avx", "__AVX2__": "avx2", "__FMA__": "fma",
    "__F16C__": "f16c", "__BMI__": "bmi1", "__BMI2__": "bmi2", "__LZCNT__": "abm",
    "__MOVBE__": "movbe", "__ADX__": "adx", "__AES__": "aes", "__PCLMUL__": "pclmulqdq",
    "__SHA__": "sha_ni", "__GFNI__": "gfni", "__VAES__": "vaes",
    "__VPCLMULQDQ__": "vpclmulqdq", "__AVXVNNI__": "avx_vnni",
    "__AVX512F__": "avx512f", "__AVX512BW__": "avx512bw", "__AVX512DQ__": "avx512dq",
    "__AVX512VL__": "avx512vl", "__AVX512CD__": "avx512cd", "__AVX512BF16__": "avx512_bf16",
    "__AVX512VNNI__": "avx512_vnni", "__AVX512VBMI__": "avx512vbmi",
    "__AVX512VBMI2__": "avx512_vbmi2", "__AVX512IFMA__": "avx512ifma",
    "__AVX512BITALG__": "avx512_bitalg", "__AVX512VPOPCNTDQ__": "avx512_vpopcntdq",
    "__AVX512FP16__": "avx512_fp16", "__AVX512VP2INTERSECT__": "avx512_vp2intersect",
    "__AMX_TILE__": "amx_tile", "__AMX_BF16__": "amx_bf16", "__AMX_INT8__": "amx_int8",
    "__AMX_FP16__": "amx_fp16",
}


@dataclass(frozen=True)
class Target:
    """What a build is made for and with; `key` names its folder."""
    march: str
    compiler: str  # the executable, as torch's builder will call it
    compiler_version: str
    requires: tuple[str, ...]  # CPU flags the target's instructions need (sorted)
    cflags: tuple[str, ...]

    @property
    def key(self) -> str:
        digest = hashlib.sha256()
        for part in (self.march, self.compiler_version, " ".join(self.requires),
                     " ".join(self.cflags), torch.__version__, platform.machine()):
            digest.update(part.encode() + b"\0")
        for path in SOURCES + HEADERS:
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
        return digest.hexdigest()[:16]


def march() -> str:
    return os.environ.get("TRITONSERVE_CPU_MARCH") or "native"


def find_compiler() -> str | None:
    name = os.environ.get("CXX") or "c++"
    return shutil.which(name) or (shutil.which("g++") if "CXX" not in os.environ else None)


def target(compiler: str, arch: str) -> Target:
    """The build's target as the compiler sees it (raises CalledProcessError where the
    compiler refuses the -march)."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             check=True).stdout.splitlines()[0].strip()
    macros = subprocess.run([compiler, f"-march={arch}", "-dM", "-E", "-x", "c++", os.devnull],
                            capture_output=True, text=True, check=True).stdout
    defined = {line.split()[1] for line in macros.splitlines() if line.startswith("#define ")}
    requires = tuple(sorted(flag for macro, flag in MACRO_FLAGS.items() if macro in defined))
    return Target(arch, compiler, version, requires, (*BASE_CFLAGS, f"-march={arch}"))


def cpu_flags() -> set[str] | None:
    """The running CPU's feature flags: Linux's /proc/cpuinfo (which leaves out what the OS
    does not enable), less what CPUID itself denies as torch's cpuinfo reads it (under an
    emulator such as qemu-user /proc/cpuinfo is the host's, while the CPU the code runs on is
    the emulated one); TRITONSERVE_CPU_FLAGS in place of both. None where nothing says."""
    override = os.environ.get("TRITONSERVE_CPU_FLAGS")
    if override is not None:
        return set(override.split())
    flags = None
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    if flags is None or platform.machine() not in ("x86_64", "AMD64"):
        return flags

    def denied(check: str) -> bool:  # a torch without the check denies nothing
        answer = getattr(torch.cpu, check, None)
        return answer is not None and not answer()

    if denied("_is_avx2_supported"):
        flags -= {"avx2"}
    if denied("_is_avx512_supported"):
        flags = {flag for flag in flags if not flag.startswith("avx512")}
    if denied("_is_avx512_bf16_supported"):
        flags -= {"avx512_bf16"}
    if denied("_is_amx_tile_supported"):
        flags = {flag for flag in flags if not flag.startswith("amx")}
    return flags


def missing_features(requires: list[str] | tuple[str, ...]) -> list[str]:
    """The features a build needs that this CPU lacks ([] where the CPU cannot be read)."""
    flags = cpu_flags()
    return [] if flags is None else [f for f in requires if f not in flags]


def root() -> Path:
    return cache_root() / "cpu_ops"


def stage_sources(folder: Path) -> list[str]:
    """The sources copied into the build folder (a file only when its contents changed), so
    every checkout of the same code names the same paths and reuses one build (ninja saw new
    paths: ~70 s here, measured). The headers are staged beside them, so ninja's dependency
    files see their changes; only the sources are returned (the build's list)."""
    staged = folder / "src"
    staged.mkdir(parents=True, exist_ok=True)
    paths = []
    for source in HEADERS + SOURCES:
        copy = staged / source.name
        text = source.read_bytes()
        if not copy.exists() or copy.read_bytes() != text:
            copy.write_bytes(text)
        if source in SOURCES:
            paths.append(str(copy))
    return paths


@dataclass(frozen=True)
class Outcome:
    """What load() did: `folder` holds the library when `loaded`; `reason` is the one line for
    the log; `note` says why the target is not the one asked for (then worth a warning)."""
    loaded: bool
    reason: str
    folder: Path | None = None
    note: str = ""


def _ninja_on_path() -> None:
    venv_bin = Path(sys.executable).parent  # pip's ninja, when the venv is not activated
    if shutil.which("ninja") is None and (venv_bin / "ninja").exists():
        os.environ["PATH"] = f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}"


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no output"


def sources_digest() -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS)).hexdigest()


def _builds() -> list[tuple[float, Path, dict]]:
    """Every finished build in the cache: (when, folder, manifest), newest first."""
    found = []
    for manifest in root().glob(f"*/{MANIFEST}"):
        try:
            found.append((manifest.stat().st_mtime, manifest.parent,
                          json.loads(manifest.read_text())))
        except (OSError, ValueError):
            continue
    return sorted(found, key=lambda build: build[0], reverse=True)


def _prebuilt() -> Path | None:
    """Without a compiler: the newest finished build of these sources for this torch that
    this CPU runs (a container image may ship one)."""
    sources = sources_digest()
    for _, folder, data in _builds():
        if (data.get("sources") == sources and data.get("torch") == torch.__version__
                and not missing_features(data.get("requires", []))
                and (folder / f"{NAME}.so").exists()):
            return folder
    return None


def _build(tgt: Target, folder: Path) -> None:
    from torch.utils import cpp_extension
    _ninja_on_path()
    cpp_extension.load(name=NAME, sources=stage_sources(folder), extra_cflags=list(tgt.cflags),
                       extra_ldflags=["-fopenmp"], build_directory=str(folder),
                       is_python_module=False, verbose=False)


def _write_manifest(tgt: Target, folder: Path) -> None:
    data = {"march": tgt.march, "compiler": tgt.compiler_version, "cflags": list(tgt.cflags),
            "torch": torch.__version__, "requires": list(tgt.requires),
            "sources": sources_digest()}
    (folder / MANIFEST).write_text(json.dumps(data, indent=1) + "\n")


def _prune(tgt: Target, keep: Path) -> None:
    """Older builds for the same target (other sources, compiler or torch) beyond the newest
    KEEP_BUILDS: each edit of a source makes a new ~20 MB folder."""
    same = [folder for _, folder, data in _builds()
            if data.get("march") == tgt.march and data.get("requires") == list(tgt.requires)]
    for folder in same[KEEP_BUILDS:]:
        if folder != keep:
            shutil.rmtree(folder, ignore_errors=True)


def choose_target(compiler: str) -> tuple[Target | None, str]:
    """The target to build, and a note when it is not the one asked for: -march as
    TRITONSERVE_CPU_MARCH says (native by default) where this CPU has every feature it names;
    for native, else the highest x86-64 level this CPU does have (the compiler saw another CPU
    than the one the code runs on: under an emulator, a hypervisor that hides features); else
    None, the note saying what is missing."""
    wanted = target(compiler, march())
    missing = missing_features(wanted.requires)
    if not missing:
        return wanted, ""
    note = f"-march={wanted.march} needs {', '.join(missing)}, which this CPU lacks"
    if wanted.march == "native" and platform.machine() in ("x86_64", "AMD64"):
        for level in ("x86-64-v3", "x86-64-v2"):
            lower = target(compiler, level)
            if not missing_features(lower.requires):
                return lower, f"{note}: built for {level}"
    return None, note


def load(rebuild: bool = False) -> Outcome:
    """Build (once per target) and load the library into torch.ops.tritonserve; never raises
    and never loads a library this CPU cannot run. rebuild: retry a build that failed."""
    if os.environ.get("TRITONSERVE_CPU_OPS", "1") == "0":
        return Outcome(False, "disabled (TRITONSERVE_CPU_OPS=0)")
    compiler = find_compiler()
    if compiler is None:
        prebuilt = _prebuilt()
        if prebuilt is None:
            return Outcome(False, "no C++ compiler and no prebuilt library for this CPU")
        return _load_library(prebuilt)
    try:
        tgt, note = choose_target(compiler)
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", None) or str(exc)
        return Outcome(False, f"{compiler} refuses -march={march()}: {_last_line(detail)}")
    if tgt is None:
        return Outcome(False, note)
    folder = root() / tgt.key
    failed = folder / FAILED
    if failed.exists() and not rebuild:
        return Outcome(False, f"the build failed before ({_last_line(failed.read_text())}; "
                              f"the whole log: {failed}; `tritonserve build-ops --rebuild` "
                              f"retries)")
    if not (folder / MANIFEST).exists() or rebuild:
        folder.mkdir(parents=True, exist_ok=True)
        failed.unlink(missing_ok=True)
        try:
            _build(tgt, folder)
        except Exception as exc:  # a compiler error, a missing ninja: keep the log, fall back
            failed.write_text(f"{type(exc).__name__}: {exc}\n")
            return Outcome(False, f"the build failed ({_last_line(str(exc))}; the whole log: "
                                  f"{failed})")
        _write_manifest(tgt, folder)
        _prune(tgt, folder)
    outcome = _load_library(folder)
    return Outcome(outcome.loaded, f"{outcome.reason} ({note})", folder, note) if note else outcome


def _load_library(folder: Path) -> Outcome:
    """Loads folder's library after checking its manifest against this CPU."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        return Outcome(False, f"no readable manifest in {folder} ({exc})")
    missing = missing_features(manifest.get("requires", []))
    if missing:
        return Outcome(False, f"the library in {folder} needs {', '.join(missing)}, which this "
                              f"CPU lacks")
    try:
        torch.ops.load_library(str(folder / f"{NAME}.so"))
    except (OSError, RuntimeError) as exc:
        return Outcome(False, f"loading {folder / (NAME + '.so')} failed: {_last_line(str(exc))}")
    return Outcome(True, f"loaded from {folder}", folder)
