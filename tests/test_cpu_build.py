"""The CPU library's build and load (kernels/cpu/build.py): a folder per target, a manifest
checked against the running CPU before loading (a library built for another CPU falls back
with a log line instead of dying of SIGILL), a failed build remembered, not retried at each
start; and the x86-64-v3 (AVX2, no AVX-512) build compiled here and put through the op
tests, so the portable paths are checked, not just written."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tritonserve.kernels import cpu
from tritonserve.kernels.cpu import build as cpu_build

ROOT = Path(__file__).resolve().parents[1]
needs_compiler = pytest.mark.skipif(cpu_build.find_compiler() is None, reason="no C++ compiler")
needs_library = pytest.mark.skipif(not cpu.load(), reason="no CPU library here")
# A CPU with SSE2 and no more: what /proc/cpuinfo says on a machine this build cannot run on
OLD_CPU = "fpu tsc cx8 cmov mmx fxsr sse sse2 syscall nx lm"


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    """code in a fresh interpreter (a library, once loaded, stays loaded in its process)."""
    run_env = {**os.environ, **env}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=run_env,
                          capture_output=True, text=True, timeout=900)


PROBE = ("import logging, torch; logging.basicConfig(level=logging.INFO); "
         "from tritonserve.kernels import cpu; print('loaded', cpu.load()); "
         "print('levels', ','.join(cpu.isa_levels())); "
         "print('in torch.ops', hasattr(torch.ops.tritonserve, 'isa_levels'))")


@needs_compiler
def test_target_names_what_the_compiler_emits_and_keys_its_folder():
    native = cpu_build.target(cpu_build.find_compiler(), "native")
    v3 = cpu_build.target(cpu_build.find_compiler(), "x86-64-v3")
    assert {"avx2", "fma", "bmi2"} <= set(v3.requires)
    assert not any(flag.startswith("avx512") for flag in v3.requires)
    assert not cpu_build.missing_features(native.requires)  # native: this CPU, by definition
    assert native.key != v3.key and len(native.key) == 16
    assert native.key == cpu_build.target(cpu_build.find_compiler(), "native").key
    other = cpu_build.Target(native.march, native.compiler, "g++ 11.3.0", native.requires,
                             native.cflags)
    assert other.key != native.key  # another compiler is another build


def test_a_manifest_this_cpu_does_not_satisfy_is_never_loaded(tmp_path, monkeypatch):
    """The library file is garbage here: had it been handed to dlopen, the reason would say
    so. The check reads the manifest first and refuses."""
    (tmp_path / cpu_build.MANIFEST).write_text(json.dumps(
        {"requires": ["avx512f", "avx512_bf16"], "torch": "x", "sources": "x"}))
    (tmp_path / f"{cpu_build.NAME}.so").write_bytes(b"not a library")
    monkeypatch.setenv("TRITONSERVE_CPU_FLAGS", "sse2 avx avx2 fma")
    outcome = cpu_build._load_library(tmp_path)
    assert not outcome.loaded
    assert "needs avx512f, avx512_bf16, which this CPU lacks" in outcome.reason
    monkeypatch.setenv("TRITONSERVE_CPU_FLAGS", "sse2 avx avx2 fma avx512f avx512_bf16")
    assert "loading" in cpu_build._load_library(tmp_path).reason  # now it would try


@needs_compiler
@needs_library
def test_a_cpu_without_the_builds_features_falls_back_with_one_log_line():
    """The build this machine made, in the shared cache, seen from a CPU that lacks its
    features: with a compiler (the target's features are missing) and without one (no
    prebuilt library fits), nothing is loaded and the log says why."""
    for env in ({"TRITONSERVE_CPU_FLAGS": OLD_CPU},
                {"TRITONSERVE_CPU_FLAGS": OLD_CPU, "CXX": "no-such-compiler"}):
        proc = _python(PROBE, **env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "loaded False" in proc.stdout and "in torch.ops False" in proc.stdout
        warnings = [line for line in proc.stderr.splitlines() if "CPU C++ ops" in line]
        assert len(warnings) == 1 and "plain-torch paths serve" in warnings[0]
        assert ("which this CPU lacks" in warnings[0]) == ("CXX" not in env)


@needs_library
def test_without_a_compiler_a_prebuilt_library_for_this_cpu_loads():
    """A container image with a warm cache and no compiler: the build whose manifest fits
    this CPU, these sources and this torch loads."""
    proc = _python(PROBE, CXX="no-such-compiler")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "loaded True" in proc.stdout and "in torch.ops True" in proc.stdout


def test_a_failed_build_is_remembered_not_retried(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITONSERVE_CACHE", str(tmp_path))
    monkeypatch.delenv("TRITONSERVE_CPU_OPS", raising=False)
    tried = []

    def failing_build(target, folder):
        tried.append(folder)
        raise RuntimeError("compiling decode_layers.cpp\nerror: 'x' was not declared")

    monkeypatch.setattr(cpu_build, "find_compiler", lambda: "c++")
    monkeypatch.setattr(cpu_build, "target", lambda compiler, arch: cpu_build.Target(
        arch, compiler, "c++ 12", ("sse2",), ("-O3",)))
    monkeypatch.setattr(cpu_build, "missing_features", lambda requires: [])
    monkeypatch.setattr(cpu_build, "_build", failing_build)
    first = cpu_build.load()
    assert not first.loaded and "the build failed (error: 'x' was not declared" in first.reason
    marker = tried[0] / cpu_build.FAILED
    assert "was not declared" in marker.read_text()
    second = cpu_build.load()  # the next start: one line, no compile
    assert len(tried) == 1 and "failed before" in second.reason and str(marker) in second.reason
    cpu_build.load(rebuild=True)  # `tritonserve build-ops --rebuild`
    assert len(tried) == 2


def test_disabled_loads_nothing(monkeypatch):
    monkeypatch.setenv("TRITONSERVE_CPU_OPS", "0")
    outcome = cpu_build.load()
    assert not outcome.loaded and "disabled" in outcome.reason


@pytest.mark.slow
@needs_compiler
def test_the_x86_64_v3_build_passes_the_op_tests():
    """-march=x86-64-v3 (AVX2 + FMA, no AVX-512) into its own folder of the same cache, then
    the C++ op tests against it: the portable attention, panels and rows, the AVX2 quantized
    tiles (the bf16-only tests skip themselves: that build has no AVX512-BF16 and says so)."""
    env = {"TRITONSERVE_CPU_MARCH": "x86-64-v3"}
    probe = _python(PROBE, **env)
    assert probe.returncode == 0, probe.stderr[-3000:]
    assert "loaded True" in probe.stdout, probe.stderr[-3000:]
    assert "levels avx2\n" in probe.stdout  # no AVX-512 level
    assert "ISA avx2" in probe.stderr
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/test_cpu_ops.py", "tests/test_cpu_panels_bf16.py", "tests/test_decode_layers.py",
         "tests/test_quant_kernels.py",
         "tests/test_moe.py::test_the_experts_op_equals_the_reference"],
        cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=900)
    assert tests.returncode == 0, tests.stdout[-4000:]
    assert " passed" in tests.stdout.splitlines()[-1]


@needs_compiler
def test_native_on_a_cpu_that_lacks_its_features_builds_the_highest_level_it_has(monkeypatch):
    """The compiler saw one CPU and the code runs on another (an emulator, a hypervisor that
    hides AVX-512): the build falls to x86-64-v3 where the CPU has AVX2, and says so."""
    compiler = cpu_build.find_compiler()
    v3 = cpu_build.target(compiler, "x86-64-v3")
    monkeypatch.delenv("TRITONSERVE_CPU_MARCH", raising=False)
    monkeypatch.setenv("TRITONSERVE_CPU_FLAGS", " ".join(v3.requires))
    native = cpu_build.target(compiler, "native")
    chosen, note = cpu_build.choose_target(compiler)
    if set(native.requires) <= set(v3.requires):  # a CPU whose native target is v3 or less
        assert chosen.march == "native" and note == ""
    else:
        assert chosen.march == "x86-64-v3" and chosen.key == v3.key
        assert "which this CPU lacks: built for x86-64-v3" in note
    monkeypatch.setenv("TRITONSERVE_CPU_FLAGS", OLD_CPU)  # below every level: nothing
    chosen, note = cpu_build.choose_target(compiler)
    assert chosen is None and "which this CPU lacks" in note


def test_older_builds_of_the_same_target_are_pruned(tmp_path, monkeypatch):
    """Each edit of a source is a new folder: the newest KEEP_BUILDS of a target stay, and
    another target's builds (another -march, another CPU's) are never touched."""
    monkeypatch.setenv("TRITONSERVE_CACHE", str(tmp_path))
    tgt = cpu_build.Target("native", "c++", "c++ 12", ("avx2", "fma"), ("-O3",))
    folders = []
    for i, (march, requires) in enumerate([("native", ["avx2", "fma"])] * 6
                                          + [("x86-64-v3", ["avx2"])]):
        folder = cpu_build.root() / f"build{i}"
        folder.mkdir(parents=True)
        (folder / cpu_build.MANIFEST).write_text(json.dumps({"march": march,
                                                             "requires": requires}))
        os.utime(folder / cpu_build.MANIFEST, (1000 + i, 1000 + i))
        folders.append(folder)
    cpu_build._prune(tgt, keep=folders[5])
    assert [f.exists() for f in folders] == [False, False, True, True, True, True, True]
