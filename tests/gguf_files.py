"""A tiny Hugging Face checkpoint written as a GGUF file the way llama.cpp's
convert_hf_to_gguf.py writes it: its metadata keys (gguf-py's Keys), tensor names (gguf-py's
TensorNameMap, the converter's own table) and transforms (q/k rows permuted for the `llama`-
style converters, Gemma's norms stored as 1 + w, Phi-3's longrope factors as tensors), the
byte-level BPE tokenizer as `gpt2` vocab, projections in F32 or Q8_0 blocks (gpt-oss's
experts in MXFP4, as llama.cpp's converter keeps them)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch

# HF architecture -> (GGUF arch, q/k permuted, norm shift)
CONVERTERS = {
    "Gemma3ForCausalLM": ("gemma3", False, 1.0),
    "Gemma2ForCausalLM": ("gemma2", False, 1.0),
    "Phi3ForCausalLM": ("phi3", False, 0.0),
    "GraniteForCausalLM": ("granite", True, 0.0),
    "Olmo2ForCausalLM": ("olmo2", False, 0.0),
    "SmolLM3ForCausalLM": ("smollm3", True, 0.0),
    "LlamaForCausalLM": ("llama", True, 0.0),
    "Qwen3MoeForCausalLM": ("qwen3moe", False, 0.0),
    "OlmoeForCausalLM": ("olmoe", False, 0.0),
    "MixtralForCausalLM": ("llama", True, 0.0),  # llama.cpp writes Mixtral as llama + experts
    "GptOssForCausalLM": ("gpt-oss", False, 0.0),
}
# a checkpoint's per-expert tensor -> (layer prefix, expert, projection); Mixtral's w1 / w2 / w3
_EXPERT = re.compile(r"(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                     r"(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight")
_W = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def _stack_experts(state: dict) -> dict:
    """Per-expert tensors stacked [E, rows, K] under the name llama.cpp's converters merge
    them into (model.layers.L.mlp.experts.gate_proj), as convert_hf_to_gguf does."""
    out, experts = {}, {}
    for name, tensor in state.items():
        found = _EXPERT.fullmatch(name)
        if found is None:
            out[name.replace(".block_sparse_moe.gate.", ".mlp.gate.")] = tensor
            continue
        prefix, e, proj = found.group(1), int(found.group(2)), found.group(3)
        experts.setdefault((prefix, _W.get(proj, proj)), {})[e] = tensor
    for (prefix, proj), by_index in experts.items():
        out[f"{prefix}.mlp.experts.{proj}.weight"] = torch.stack(
            [by_index[e] for e in sorted(by_index)])
    return out


def _split_gpt_oss(state: dict) -> dict:
    """llama.cpp's GptOssModel.modify_tensors: each layer's gate_up_proj [E, H, 2I] (gate and
    up columns interleaved) split into stacked gate and up [E, I, H], down_proj [E, I, H]
    transposed to [E, H, I], the biases alike; the sinks as a weight."""
    out = {}
    for name, t in state.items():
        base, _, proj = name.rpartition(".mlp.experts.")
        if proj == "gate_up_proj":
            t = t.transpose(1, 2)
            out[f"{base}.mlp.experts.gate_proj.weight"] = t[:, 0::2]
            out[f"{base}.mlp.experts.up_proj.weight"] = t[:, 1::2]
        elif proj == "gate_up_proj_bias":
            out[f"{base}.mlp.experts.gate_proj.bias"] = t[:, 0::2]
            out[f"{base}.mlp.experts.up_proj.bias"] = t[:, 1::2]
        elif proj == "down_proj":
            out[f"{base}.mlp.experts.down_proj.weight"] = t.transpose(1, 2)
        elif proj == "down_proj_bias":
            out[f"{base}.mlp.experts.down_proj.bias"] = t
        elif name.endswith(".sinks"):
            out[f"{name}.weight"] = t
        else:
            out[name] = t
    return out


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute: rotate-half rows into interleaved pairs."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _rope_keys(writer, gguf, config: dict) -> None:
    rope = config.get("rope_parameters") or {}
    if "full_attention" in rope:  # Gemma 3: the global layers' scaling is the file's
        rope = rope["full_attention"]
    kind = rope.get("rope_type", "default")
    if kind in ("linear", "yarn"):
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR if kind == "linear"
                                     else gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        if kind == "yarn":
            writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))


def write_gguf(folder: Path, path: Path, quantized: bool = False) -> Path:
    import gguf
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())
    architecture = config["architectures"][0]
    arch, permuted, shift = CONVERTERS[architecture]
    n_layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(n_layers)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-6))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = config.get("rope_parameters") or {}
    theta = (rope.get("full_attention") or rope).get("rope_theta", 10000.0)
    writer.add_rope_freq_base(float(theta))
    fraction = rope.get("partial_rotary_factor") or config.get("partial_rotary_factor") or 1.0
    writer.add_rope_dimension_count(int(head_dim * fraction))
    _rope_keys(writer, gguf, config)
    if config.get("sliding_window") and arch in ("gemma2", "gemma3", "phi3", "gpt-oss"):
        writer.add_sliding_window(int(config["sliding_window"]))
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(float(config["attn_logit_softcapping"]))
        writer.add_final_logit_softcapping(float(config["final_logit_softcapping"]))
    if arch == "granite":
        writer.add_embedding_scale(float(config["embedding_multiplier"]))
        writer.add_residual_scale(float(config["residual_multiplier"]))
        writer.add_attention_scale(float(config["attention_multiplier"]))
        writer.add_logit_scale(float(config["logits_scaling"]))
    if rope.get("rope_type") == "longrope":  # llama.cpp's Phi3MiniModel
        import math
        scale = config["max_position_embeddings"] / rope["original_max_position_embeddings"]
        writer.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(rope["original_max_position_embeddings"]))
            if scale > 1 else 1.0)
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
        for name in ("long", "short"):
            writer.add_tensor(f"rope_factors_{name}.weight",
                              np.asarray(rope[f"{name}_factor"], dtype=np.float32))
    experts = config.get("num_experts") or config.get("num_local_experts")
    if experts:
        writer.add_expert_count(int(experts))
        writer.add_expert_used_count(int(config["num_experts_per_tok"]))
        if config.get("moe_intermediate_size"):
            writer.add_expert_feed_forward_length(int(config["moe_intermediate_size"]))
        if arch == "gpt-oss":
            writer.add_expert_feed_forward_length(int(config["intermediate_size"]))
    _tokenizer(writer, folder)

    names = gguf.get_tensor_name_map(
        next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), n_layers)
    state = load_file(str(folder / "model.safetensors"))
    state = _split_gpt_oss(state) if arch == "gpt-oss" else _stack_experts(state)
    for name, tensor in state.items():
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue  # the converters skip a tied head
        tensor = tensor.float()
        base, suffix = name.rsplit(".", 1)
        target = names.get_name(base)
        assert target is not None, f"no GGUF name for {name}"
        if shift and name.endswith("norm.weight"):
            tensor = tensor + shift
        if permuted and base.endswith(("q_proj", "k_proj")):
            tensor = _permute(tensor, heads if base.endswith("q_proj") else kv_heads)
        data = tensor.numpy()
        if quantized and suffix == "weight" and data.ndim in (2, 3) and \
                data.shape[-1] % 32 == 0 and not base.endswith(("mlp.gate", "mlp.router")):
            # llama.cpp keeps the router in F32; gpt-oss's experts stay MXFP4
            kind = gguf.GGMLQuantizationType.Q8_0
            if arch == "gpt-oss" and data.ndim == 3:
                kind = gguf.GGMLQuantizationType.MXFP4
            blocks = gguf.quants.quantize(data, kind)
            writer.add_tensor(f"{target}.{suffix}", blocks, raw_shape=blocks.shape,
                              raw_dtype=kind)
        else:
            writer.add_tensor(f"{target}.{suffix}", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tokenizer(writer, folder: Path) -> None:
    """The tiny byte-level BPE as llama.cpp's `gpt2` vocab: tokens, types, merges, ids and the
    chat template."""
    import gguf

    data = json.loads((folder / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    specials = {t["content"]: t["id"] for t in data["added_tokens"]}
    tokens = [None] * (max(list(vocab.values()) + list(specials.values())) + 1)
    for token, i in {**vocab, **specials}.items():
        tokens[i] = token
    types = [gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    config = json.loads((folder / "tokenizer_config.json").read_text())
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(specials[config["bos_token"]])
    writer.add_eos_token_id(specials[config["eos_token"]])
    writer.add_pad_token_id(specials[config["pad_token"]])
    writer.add_add_bos_token(False)
    template = config.get("chat_template")
    if template is None and (folder / "chat_template.jinja").exists():
        template = (folder / "chat_template.jinja").read_text()
    writer.add_chat_template(template)


def write_gguf_lora(adapter: Path, base: Path, path: Path, outtype: str = "f32") -> Path:
    """A PEFT adapter folder written as llama.cpp's convert_lora_to_gguf.py writes it:
    general.type adapter, adapter.type lora, adapter.lora.alpha; each projection's
    `<base tensor>.lora_a` (A [r, in]) and `.lora_b` (B [out, r], its rows permuted as the
    base's q / k rows are for the llama-style converters), in F32, F16 or Q8_0 (outtype)."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((base / "config.json").read_text())
    lora_config = json.loads((adapter / "adapter_config.json").read_text())
    arch, permuted, _ = CONVERTERS[config["architectures"][0]]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(lora_config["lora_alpha"]))
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()),
                                     config["num_hidden_layers"])
    for name, tensor in sorted(load_file(str(adapter / "adapter_model.safetensors")).items()):
        base_name = name.replace("base_model.model.", "").rsplit(".lora_", 1)[0]
        which = "a" if ".lora_A." in name else "b"
        tensor = tensor.float()
        if which == "b" and permuted and base_name.endswith(("q_proj", "k_proj")):
            tensor = _permute(tensor, heads if base_name.endswith("q_proj") else kv_heads)
        target = f"{names.get_name(base_name)}.weight.lora_{which}"
        data = tensor.numpy()
        if outtype == "f16":
            writer.add_tensor(target, data.astype(np.float16))
        elif outtype == "q8_0" and data.shape[-1] % 32 == 0:
            blocks = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(target, blocks, raw_shape=blocks.shape,
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(target, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
