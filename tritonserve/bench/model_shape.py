"""tritonserve bench model-shape --out DIR [--shape gemma-3-270m]: a random checkpoint with the
shape of a released model, written as a Hugging Face folder (bf16 safetensors, config.json,
tokenizer, chat template) for the side-by-side figures (bench/family_figures.sh), which then
convert it with llama.cpp's own converter and quantize it with llama.cpp's quantizer.

The tokenizer is the embedded SmolLM2's (a byte-level BPE llama.cpp's converter knows by its
pre-tokenizer hash), its vocabulary padded with unreachable tokens to the shape's size: llama.cpp's
Gemma 3 converter cuts the embedding to the tokenizer's length, so a 262k head needs 262k
tokens. Random weights (seeded): the figures are about speed, the text is noise."""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

SHAPES = {
    # google/gemma-3-270m's config.json: 18 layers, a global layer after every five sliding ones
    "gemma-3-270m": dict(
        architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_size=640,
        intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3,
        max_position_embeddings=32768, rms_norm_eps=1e-6, vocab_size=262144,
        tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
}


def write_tokenizer(source: Path, out: Path, vocab_size: int) -> dict:
    """SmolLM2's tokenizer with its BPE vocabulary padded to vocab_size; returns its special
    token ids."""
    data = json.loads((source / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    taken = len(vocab) + sum(1 for t in data["added_tokens"] if t["content"] not in vocab)
    for i in range(vocab_size - taken):
        vocab[f"<unused_{i}>"] = len(vocab)
    (out / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    config = json.loads((source / "config.json").read_text())
    return {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}


def write_shape(shape: str, out: Path, seed: int = 0) -> Path:
    import torch
    import transformers

    from tritonserve.engine.default_model import default_model_path

    out.mkdir(parents=True, exist_ok=True)
    fields = dict(SHAPES[shape])
    specials = write_tokenizer(Path(default_model_path()), out, fields["vocab_size"])
    architecture = fields.pop("architectures")[0]
    fields.pop("model_type")
    config = transformers.Gemma3TextConfig(**fields, **specials, pad_token_id=0)
    config.architectures = [architecture]
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = getattr(transformers, architecture)(config).to(torch.bfloat16).eval()
    model.save_pretrained(out, safe_serialization=True)
    config_path = out / "config.json"
    written = json.loads(config_path.read_text())
    written["dtype"] = "bfloat16"
    config_path.write_text(json.dumps(written, indent=2))
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tritonserve bench model-shape")
    parser.add_argument("--out", required=True, help="folder to write")
    parser.add_argument("--shape", default="gemma-3-270m", choices=sorted(SHAPES))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    folder = write_shape(args.shape, Path(args.out), args.seed)
    print(f"{args.shape}: {folder}")
    return 0
