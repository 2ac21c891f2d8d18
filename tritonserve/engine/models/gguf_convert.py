"""A GGUF file of a family whose file says more than transformers' GGUF loader reads (or
whose architecture it does not read at all), converted into a Hugging Face folder: config.json
from the file's metadata (the family's `gguf_config` adds its own keys), the tensors
dequantized and renamed, with the transforms llama.cpp's converter applied undone (q/k rows
put back in rope order, Gemma's stored 1 + w norms back to w), and the tokenizer through
transformers' GGUF tokenizer builder (which reads any architecture's vocab).

Why not transformers' loader for these: it refuses granite, olmo2 and smollm3 files, and for
gemma3 / gemma2 / phi3 it drops what their configs need (the global layers' rope scaling, the
soft-caps, the partial rotary dims, Phi-3's longrope factors, which llama.cpp stores as
tensors). The families transformers reads fully (llama, mistral, qwen2, qwen3) keep its path
(engine/default_model.py picks: `converts_itself`).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from .family import FAMILIES, ModelFamily, supported_gguf_architectures
from .gguf import experts_served, unpermute_rows
from .moe import PROJECTIONS, fused_experts, stacked_name


class GGUFMeta:
    """A file's metadata by gguf-py's key templates ("{arch}.rope.freq_base"), and its small
    non-weight tensors (rope factors)."""

    def __init__(self, reader) -> None:
        self.fields = {name: field.contents() for name, field in reader.fields.items()
                       if not name.startswith("GGUF.")}
        self.arch = self.fields["general.architecture"]
        self.tensors = {t.name: t for t in reader.tensors}

    def get(self, key: str, default=None):
        return self.fields.get(key.format(arch=self.arch), default)

    def vector(self, tensor: str) -> list[float] | None:
        t = self.tensors.get(tensor)
        return None if t is None else [float(x) for x in np.asarray(t.data).reshape(-1)]


def family_of_gguf(arch: str, experts: bool = False) -> tuple[ModelFamily, str] | None:
    """The family and Hugging Face architecture of a GGUF `general.architecture`, whose file
    has expert tensors or not (a `llama` file with experts is Mixtral)."""
    found = [f for f in FAMILIES.values() if arch in f.gguf_archs
             and f.gguf_experts in (None, experts)]
    if not found:
        return None
    family = next((f for f in found if f.gguf_experts is not None), found[0])
    return family, family.gguf_archs[arch]


def has_experts(reader) -> bool:
    return any(t.name.endswith("_exps.weight") for t in reader.tensors)


def converts_itself(gguf_file: Path) -> bool:
    """The file is one this module converts (its family has a gguf_config); a file of no
    family's architecture is one ValueError naming it and the ones served."""
    import gguf
    reader = gguf.GGUFReader(str(gguf_file))
    arch = reader.fields["general.architecture"].contents()
    found = family_of_gguf(arch, has_experts(reader))
    if found is None:
        raise ValueError(f"{gguf_file.name}: GGUF architecture {arch!r} is not supported "
                         f"(supported: {', '.join(supported_gguf_architectures())})")
    return found[0].gguf_config is not None


# harmony's end-of-generation tokens (gpt-oss): generation_config.json lists both; llama.cpp's
# converter writes only <|return|> as EOS and its vocab loader adds them by text
HARMONY_ENDS = ("<|return|>", "<|call|>")


def config_of(meta: GGUFMeta, family: ModelFamily, architecture: str) -> dict:
    """config.json from the generic keys (gguf-py's Keys), then the family's own."""
    import gguf
    LLM, Attention, Rope = gguf.Keys.LLM, gguf.Keys.Attention, gguf.Keys.Rope
    heads = int(meta.get(Attention.HEAD_COUNT))
    hidden = int(meta.get(LLM.EMBEDDING_LENGTH))
    head_dim = int(meta.get(Attention.KEY_LENGTH) or hidden // heads)
    tokens = meta.fields["tokenizer.ggml.tokens"]
    eos = [meta.fields[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
           if k in meta.fields]
    if HARMONY_ENDS[0] in tokens:  # gpt-oss: a tool call ends the turn too (as llama.cpp's EOG)
        eos += [tokens.index(text) for text in HARMONY_ENDS if text in tokens]
    config = {
        "architectures": [architecture],
        "model_type": family.model_types[0],
        "vocab_size": len(tokens),
        "hidden_size": hidden,
        "intermediate_size": int(meta.get(LLM.FEED_FORWARD_LENGTH)),
        "num_hidden_layers": int(meta.get(LLM.BLOCK_COUNT)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(Attention.HEAD_COUNT_KV) or heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(meta.get(Attention.LAYERNORM_RMS_EPS, 1e-6)),
        "rope_theta": float(meta.get(Rope.FREQ_BASE, 10000.0)),
        "max_position_embeddings": int(meta.get(LLM.CONTEXT_LENGTH, 4096)),
        "tie_word_embeddings": "output.weight" not in meta.tensors,
        "bos_token_id": meta.fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos[0] if len(eos) == 1 else sorted(set(eos)) or None,
        "pad_token_id": meta.fields.get("tokenizer.ggml.padding_token_id"),
    }
    rotary = meta.get(Rope.DIMENSION_COUNT)
    if rotary and int(rotary) < head_dim:
        config["partial_rotary_factor"] = int(rotary) / head_dim
    kind = meta.get(Rope.SCALING_TYPE)
    if kind in ("linear", "yarn"):
        config["rope_scaling"] = {"rope_type": kind,
                                  "factor": float(meta.get(Rope.SCALING_FACTOR, 1.0))}
        original = meta.get(Rope.SCALING_ORIG_CTX_LEN)
        if original:
            config["rope_scaling"]["original_max_position_embeddings"] = int(original)
    experts = meta.get(LLM.EXPERT_COUNT)
    if experts:  # a mixture of experts; a layer without stacked experts keeps a dense MLP
        config.update(
            num_experts=int(experts), num_experts_per_tok=int(meta.get(LLM.EXPERT_USED_COUNT)),
            moe_intermediate_size=int(meta.get(LLM.EXPERT_FEED_FORWARD_LENGTH)
                                      or config["intermediate_size"]),
            mlp_only_layers=[i for i in range(config["num_hidden_layers"])
                             if f"blk.{i}.ffn_gate_exps.weight" not in meta.tensors])
        norm = meta.get(LLM.EXPERT_WEIGHTS_NORM)
        if norm is not None:
            config["norm_topk_prob"] = bool(norm)
    family.gguf_config(meta, config)
    return config


def tensor_names(family: ModelFamily, config: dict, gguf_arch: str) -> dict[str, str]:
    """The file's tensor names -> the checkpoint's, by gguf-py's TensorNameMap (the table
    llama.cpp's converter writes with) over the names this model's checkpoint has."""
    import gguf

    from .arch import ModelArch
    from .decoder import DecoderForCausalLM
    from .loader import checkpoint_slots

    arch = ModelArch.from_dict(config)
    with torch.device("meta"):
        model = DecoderForCausalLM(arch, 1)
    names = gguf.get_tensor_name_map(
        next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == gguf_arch),
        arch.num_layers)
    out = {}
    for i in range(arch.num_layers):  # experts: one stacked tensor a projection (moe.py)
        for proj in PROJECTIONS:
            stored = names.get_name(f"model.layers.{i}.mlp.experts.{proj}")
            if stored is not None:
                out[f"{stored}.weight"] = stacked_name(i, proj)
                out[f"{stored}.bias"] = stacked_name(i, proj)[:-len("weight")] + "bias"
    for hf in checkpoint_slots(model):
        base, _, suffix = hf.rpartition(".")
        stored = names.get_name(base)
        if stored is not None:
            out[f"{stored}.{suffix}"] = hf
        elif (whole := names.get_name(hf)) is not None:  # a bare parameter (gpt-oss's sinks)
            out[f"{whole}.weight"] = hf
            out[whole] = hf
    return out


def convert(gguf_file: Path, work: Path) -> None:
    """Write config.json, generation_config.json, model.safetensors and the tokenizer of
    `gguf_file` into the folder `work`."""
    import gguf
    from gguf.quants import dequantize
    from safetensors.torch import save_file
    from transformers import PreTrainedTokenizerFast

    reader = gguf.GGUFReader(str(gguf_file))
    meta = GGUFMeta(reader)
    family, architecture = family_of_gguf(meta.arch, has_experts(reader))
    config = config_of(meta, family, architecture)
    names = tensor_names(family, config, meta.arch)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    # experts served as blocks are left out (a 30B-A3B file's would be 120 GB in fp32); a
    # dense load dequantizes them from the file itself (gguf.dense_experts)
    blocks_only = experts_served(gguf_file, reader)
    state = {}
    for tensor in reader.tensors:
        if blocks_only and tensor.name.endswith("_exps.weight"):
            continue
        name = names.get(tensor.name)
        if name is None:
            if tensor.name.startswith("rope_factors_"):
                continue  # read into the config (phi3.py)
            raise ValueError(f"{gguf_file.name}: tensor {tensor.name} has no place in "
                             f"{architecture}")
        shape = tuple(reversed([int(s) for s in tensor.shape]))
        data = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        weight = torch.from_numpy(np.array(data, dtype=np.float32))  # a copy: the file is read-only
        if family.gguf_rope_permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            weight = unpermute_rows(weight, heads if "q_proj" in name else kv_heads)
        if family.gguf_norm_shift and name.endswith("norm.weight"):
            weight = weight - family.gguf_norm_shift
        state[name] = weight.contiguous()
    if family.gguf_fused_experts:
        state = fused_experts(state)
    save_file(state, str(work / "model.safetensors"), metadata={"format": "pt"})
    (work / "config.json").write_text(json.dumps(config, indent=2))
    (work / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(gguf_file.parent),
                                                        gguf_file=gguf_file.name)
    tokenizer.save_pretrained(work)
