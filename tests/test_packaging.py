"""The distribution ships one import name, `tritonserve`: our top-level `kernels` once shadowed
Hugging Face's `kernels` package, which transformers 5.25 imports, and neither the server nor
the tests started. The wheel is built offline and read; the command line is run as installed."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    source = tmp_path_factory.mktemp("source")  # setuptools writes build/ into the tree it builds
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "tritonserve", source / "tritonserve",
                    ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                           "--no-build-isolation", "--no-index", "-w", str(out), str(source)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return zipfile.ZipFile(next(out.glob("tritonserve-*.whl")))


def test_the_wheel_ships_one_top_level_name_and_its_sources(wheel):
    names = wheel.namelist()
    tops = {name.split("/")[0] for name in names if ".dist-info/" not in name}
    assert tops == {"tritonserve"}
    info = next(name for name in names if name.endswith(".dist-info/top_level.txt"))
    assert wheel.read(info).decode().split() == ["tritonserve"]
    for part in ("engine", "kernels", "server", "bench"):  # the design card's four parts
        assert f"tritonserve/{part}/__init__.py" in names
    # what the C++ build and the operator scripts need, beside the code
    assert {"tritonserve/kernels/cpu/decode_layers.cpp", "tritonserve/kernels/cpu/isa.h",
            "tritonserve/bench/gpu_check.sh"} <= set(names)
    entry = next(name for name in names if name.endswith(".dist-info/entry_points.txt"))
    assert "tritonserve = tritonserve.cli:main" in wheel.read(entry).decode()


def test_transformers_imports_its_own_kernels_package_beside_ours(tmp_path):
    """From the repo root (first on sys.path, as in the tests and `python -m`): transformers'
    model code imports HF's `kernels` where it is installed, and ours is tritonserve.kernels."""
    code = ("import importlib.util, transformers.activations, tritonserve.kernels; "
            "spec = importlib.util.find_spec('kernels'); "
            "print(spec.origin if spec else None)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    origin = proc.stdout.strip()
    assert origin == "None" or "site-packages" in Path(origin).parts  # never a repo folder


def test_the_command_line_hands_each_subcommand_on():
    tritonserve = BIN / "tritonserve"
    program = [str(tritonserve)] if tritonserve.exists() else [sys.executable, "-m", "tritonserve"]
    usage = subprocess.run([*program, "--help"], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 0
    for command in ("serve", "generate", "bench", "build-ops"):
        assert f"tritonserve {command}" in usage.stdout
    wrong = subprocess.run([*program, "launch"], capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 2 and "unknown command 'launch'" in wrong.stderr
    serve = subprocess.run([*program, "serve", "--help"], capture_output=True, text=True,
                           timeout=120)
    assert serve.returncode == 0 and "--decode-mode" in serve.stdout
    bench = subprocess.run([*program, "bench", "nothing"], capture_output=True, text=True,
                           timeout=120)
    assert bench.returncode == 2 and "throughput" in bench.stderr


def test_serve_takes_the_model_as_its_first_argument(monkeypatch):
    from tritonserve import cli
    seen = []
    monkeypatch.setattr("tritonserve.server.__main__.main", lambda argv: seen.append(argv) or 0)
    assert cli.main(["serve", "/models/llama", "--port", "9000"]) == 0
    assert cli.main(["serve", "--port", "9001"]) == 0
    assert seen == [["--model", "/models/llama", "--port", "9000"], ["--port", "9001"]]


def test_scripts_use_the_package_names_and_the_projects_venv():
    """Every shell script imports through `tritonserve.` and runs .venv's interpreter where
    the README's set-up made one (gpu_check.sh once ran `python3` from PATH: no torch there);
    check_latest.sh alone makes a venv of its own, on purpose."""
    import re
    scripts = sorted((ROOT / "scripts").glob("*.sh")) + sorted(
        (ROOT / "tritonserve" / "bench").glob("*.sh"))
    assert len(scripts) >= 6
    for script in scripts:
        text = script.read_text()
        stale = re.findall(r"(?:from|import|-m) (?:engine|bench|kernels|server)\b", text)
        assert not stale, f"{script.name}: {stale}"
        if script.name != "check_latest.sh" and re.search(r"\bpython3?\b", text):
            assert ".venv/bin/" in text, script.name
