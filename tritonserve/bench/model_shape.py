"""tritonserve bench model-shape --out DIR [--shape gemma-3-270m | qwen3-moe-2.6b-a0.4b]: a random
checkpoint with the shape of a released model (or, for a mixture of experts, of one scaled to a
small machine), written as a Hugging Face folder (bf16 safetensors, config.json,
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
    # issue 65's MoE shape scaled to a 2-core CPU: Qwen3-30B-A3B's layout (64 experts of 512
    # rows here for its 128 of 768, top 8, q/k norms, GQA 16:4 of head size 64), 24 layers
    # of hidden 1024: 2.6 B weights (~1.5 GB as Q4_K_M), 0.39 B of them read a token
    "qwen3-moe-2.6b-a0.4b": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=1024,
        intermediate_size=3072, moe_intermediate_size=512, num_hidden_layers=24,
        num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=64,
        num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=32768,
        rms_norm_eps=1e-6, vocab_size=49152, tie_word_embeddings=False, hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
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
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields, **specials,
                                               pad_token_id=0)
    config.architectures = [architecture]
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: no fp32 copy of 2.6 B weights
    try:
        with torch.device("cpu"):
            model = getattr(transformers, architecture)(config).eval()
    finally:
        torch.set_default_dtype(default)
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
