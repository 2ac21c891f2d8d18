"""gpt-oss (gpt-oss-20b, gpt-oss-120b): Llama's pre-norm layer with biases on q, k, v and o,
a learned sink logit per query head in every softmax (DecoderVariant.sinks), sliding-window
layers (128 tokens) between full ones by config.json's layer_types, YaRN rope, and a
mixture-of-experts MLP whose router and experts carry biases: top-k of the router's logits,
then a softmax over those k, and the clamped SwiGLU (Experts.softmax_last / bias /
swiglu_limit). The checkpoint stacks each layer's experts as transformers' GptOssExperts
holds them: gate_up_proj [E, H, 2I] with gate and up columns interleaved, down_proj
[E, I, H], and their biases; `split_experts` gives each expert's own tensors. llama.cpp
writes it as `gpt-oss`, the experts split into ffn_gate_exps / ffn_up_exps / ffn_down_exps
(with .bias each) in MXFP4, served as exact s8 blocks (engine/models/gguf.py)."""
from dataclasses import replace

import torch

from ..family import ModelFamily, experts_from, variant_from
from .gemma import layer_kinds

_EXPERTS = ".mlp.experts."


def gpt_oss_variant(config: dict):
    kinds = layer_kinds(config, 2)
    window = config.get("sliding_window")
    experts = replace(experts_from(config, normalize=False), softmax_last=True, bias=True,
                      swiglu_limit=float(config.get("swiglu_limit", 7.0)),
                      swiglu_alpha=float(config.get("swiglu_alpha", 1.702)))
    return variant_from(
        config, qkv_bias=bool(config.get("attention_bias", True)),
        o_bias=bool(config.get("attention_bias", True)), sinks=True, experts=experts,
        windows=tuple(int(window) if k == "sliding_attention" and window else None
                      for k in kinds))


def split_experts(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
    """A stacked gpt-oss expert tensor -> each expert's tensors by the decoder's names
    (engine/models/moe.py's expert_slots), or None for any other tensor."""
    base, found, proj = name.rpartition(_EXPERTS)
    if not found or "." in proj:
        return None
    p = f"{base}{_EXPERTS}"
    out = []
    for e, t in enumerate(tensor):
        if proj == "gate_up_proj":  # [H, 2I], gate columns even, up columns odd
            out += [(f"{p}{e}.gate_proj.weight", t[:, 0::2].t()),
                    (f"{p}{e}.up_proj.weight", t[:, 1::2].t())]
        elif proj == "gate_up_proj_bias":
            out += [(f"{p}{e}.gate_proj.bias", t[0::2]), (f"{p}{e}.up_proj.bias", t[1::2])]
        elif proj == "down_proj":  # [I, H]
            out.append((f"{p}{e}.down_proj.weight", t.t()))
        elif proj == "down_proj_bias":
            out.append((f"{p}{e}.down_proj.bias", t))
        else:
            return None
    return out


def gpt_oss_gguf_config(meta, config: dict) -> None:
    """What llama.cpp's gpt-oss converter writes and its graph assumes: the window (every
    other layer, the first sliding), biases on q, k, v and o, YaRN without truncating its
    correction range (gpt-oss's own rope_parameters), the SwiGLU limit 7 and alpha 1.702 (the
    file does not carry them), the router's weights not renormalised past its softmax."""
    import gguf

    config["sliding_window"] = meta.get(gguf.Keys.Attention.SLIDING_WINDOW)
    config["attention_bias"] = True
    config.update(swiglu_limit=7.0, swiglu_alpha=1.702)
    if config.get("rope_scaling"):
        config["rope_scaling"].update(truncate=False, beta_fast=32.0, beta_slow=1.0)


FAMILY = ModelFamily(
    name="gpt_oss", architectures=("GptOssForCausalLM",), model_types=("gpt_oss",),
    variant=gpt_oss_variant, checkpoint_subs=((r"\.mlp\.router\.", ".mlp.gate."),),
    checkpoint_split=split_experts, gguf_archs={"gpt-oss": "GptOssForCausalLM"},
    gguf_config=gpt_oss_gguf_config, gguf_experts=True, gguf_fused_experts=False)
