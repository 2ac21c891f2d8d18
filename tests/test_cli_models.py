"""`--help` lists the models served; a model we cannot serve is one line on stderr and exit
status 2 from `tritonserve generate` and `tritonserve serve`, never a traceback: an unknown
architecture in an HF folder names itself and the ones served, an unknown GGUF architecture
likewise, and a config.json missing a field the family needs names the field."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tritonserve.engine.models import supported_architectures

ROOT = Path(__file__).resolve().parents[1]


def run_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    # away from the repo root: the installed package, as a user runs it
    return subprocess.run([sys.executable, "-m", "tritonserve", *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, proc.stderr[-2000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def folder_with(tmp_path: Path, config: dict) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_unknown_architecture_is_one_line_naming_the_supported(tmp_path, command):
    folder = folder_with(tmp_path, {"architectures": ["Gemma3nForCausalLM"],
                                    "model_type": "gemma3n", "hidden_size": 64})
    args = ["--prompt", "hi"] if command == "generate" else ["--port", "0"]
    line = assert_one_line_error(run_cli(tmp_path, command, "--model", str(folder), *args),
                                 "Gemma3nForCausalLM is not supported (supported: ")
    for arch in ("Gemma3ForCausalLM", "Phi3ForCausalLM", "GraniteForCausalLM",
                 "Olmo2ForCausalLM", "SmolLM3ForCausalLM", "LlamaForCausalLM"):
        assert arch in line and arch in supported_architectures()


def test_missing_config_field_names_it(tmp_path):
    folder = folder_with(tmp_path, {"architectures": ["LlamaForCausalLM"], "vocab_size": 64,
                                    "num_hidden_layers": 2, "num_attention_heads": 4,
                                    "intermediate_size": 128})
    assert_one_line_error(run_cli(tmp_path, "generate", "--model", str(folder),
                                  "--prompt", "hi"),
                          "config.json has no 'hidden_size'")


def test_unknown_gguf_architecture_is_one_line(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "gemma3n-tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3n")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_one_line_error(run_cli(tmp_path, "generate", "--model", str(path), "--prompt", "hi"),
                          "GGUF architecture 'gemma3n' is not supported (supported: ",
                          "gemma3", "phi3", "llama")


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_help_lists_the_supported_families(tmp_path, command):
    from tritonserve.engine.models import supported_gguf_architectures

    proc = run_cli(tmp_path, command, "--help")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())  # argparse wraps the epilog
    for name in supported_architectures() + supported_gguf_architectures():
        assert name in text, name
