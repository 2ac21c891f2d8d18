"""Model families: one file each in `families/`, found by name at import. A family maps a
checkpoint's config (Hugging Face config.json, or the one transformers writes for a GGUF file)
to a DecoderVariant: the typed list of ways its decoder differs from Llama's. The generic
decoder (decoder.py), the checkpoint's names (loader.py), the GGUF name map (gguf.py) and the
layers op's support check (plan.py) all read the variant; none of them names a family.

Adding a family is adding one file (docs/howto/add-a-model-family.md):

    FAMILY = ModelFamily(name="...", architectures=("...ForCausalLM",), model_types=("...",),
                         variant=lambda config: variant_from(config, norm_placement="post"))
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Callable, Mapping

NORM_PLACEMENTS = ("pre", "post", "sandwich")
# config.json's hidden_act -> the gate's activation (gelu_tanh: GELU with the tanh
# approximation, what Gemma's gelu_pytorch_tanh computes)
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh",
               "gelu_tanh": "gelu_tanh"}
ROPE_KINDS = ("default", "llama3", "linear")

# llama.cpp's block tensor names -> the checkpoint's module names (gguf.py's hf_name)
LLAMA_GGUF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                    "ffn_down": "mlp.down_proj"}


@dataclass(frozen=True)
class DecoderVariant:
    """How one model's decoder differs from Llama's; each default is Llama's.

    norm_placement: pre (norm, sublayer, add: Llama), post (sublayer, norm, add: OLMo 2),
      sandwich (norm, sublayer, norm, add: Gemma 2/3). norm_offset: each RMSNorm scales by
      offset + weight (Gemma stores weight - 1: offset 1.0), folded into the weight at load.
    activation: the gate's, silu or gelu_tanh. qk_norm: None, or "head" (an RMSNorm over each
      head's q and k before rope: Qwen3). qkv_bias: q, k and v carry biases (Qwen2).
    rope_kind: default, llama3 or linear (the scaling of ModelArch.rope_scaling);
      rope_bases: a base per layer, () for ModelArch.rope_theta everywhere.
    windows: an attention window per layer (None: the whole context), () for none at all.
    embedding_scale: the embedding's rows times this (Gemma: sqrt(hidden)).
    tied_head: the output layer is the embedding table. logit_softcap: logits become
      cap * tanh(logits / cap) (Gemma 2), None for none."""

    norm_placement: str = "pre"
    norm_offset: float = 0.0
    activation: str = "silu"
    qk_norm: str | None = None
    qkv_bias: bool = False
    rope_kind: str = "default"
    rope_bases: tuple[float, ...] = ()
    windows: tuple[int | None, ...] = ()
    embedding_scale: float = 1.0
    tied_head: bool = False
    logit_softcap: float | None = None

    def __post_init__(self) -> None:
        checks = (("norm_placement", self.norm_placement, NORM_PLACEMENTS),
                  ("activation", self.activation, tuple(set(ACTIVATIONS.values()))),
                  ("qk_norm", self.qk_norm, (None, "head")),
                  ("rope_kind", self.rope_kind, ROPE_KINDS))
        for name, value, allowed in checks:
            if value not in allowed:
                raise ValueError(f"{name} {value!r} is not supported; supported: "
                                 f"{', '.join(map(str, allowed))}")

    def norm_names(self) -> tuple[str, ...]:
        """A layer's norms, by the checkpoint's names, in the order they run."""
        return {"pre": ("input_layernorm", "post_attention_layernorm"),
                "post": ("post_attention_layernorm", "post_feedforward_layernorm"),
                "sandwich": ("input_layernorm", "post_attention_layernorm",
                             "pre_feedforward_layernorm", "post_feedforward_layernorm"),
                }[self.norm_placement]

    @property
    def widest_window(self) -> int | None:
        return max((w for w in self.windows if w), default=None)

    def layers_op_refusal(self) -> str | None:
        """Why the C++ layers op (kernels/cpu/decode_layers.cpp, which runs Llama's layer with
        an optional qkv bias) cannot run this decoder, or None when it can."""
        differs = [what for what, odd in (
            (f"{self.norm_placement} norms", self.norm_placement != "pre"),
            (f"{self.activation} activation", self.activation != "silu"),
            ("q/k norms", self.qk_norm is not None),
            ("a rope base per layer", len(set(self.rope_bases)) > 1),
            ("an embedding scale", self.embedding_scale != 1.0),
            ("a logit soft-cap", self.logit_softcap is not None)) if odd]
        return ", ".join(differs) or None


def variant_from(config: dict, **family: object) -> DecoderVariant:
    """The variant the config's generic keys say (hidden_act, attention_bias,
    tie_word_embeddings, rope scaling, sliding_window), with the family's own fields over
    them. A sliding window here is every layer's; a family with a window per layer passes
    `windows` itself."""
    act = config.get("hidden_act") or config.get("hidden_activation") or "silu"
    if act not in ACTIVATIONS:
        raise ValueError(f"hidden_act {act!r} is not supported; supported: "
                         f"{', '.join(ACTIVATIONS)}")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    window = config.get("sliding_window")
    generic = dict(
        activation=ACTIVATIONS[act],
        qkv_bias=bool(config.get("attention_bias", False)),
        rope_kind=rope.get("rope_type", rope.get("type", "default")),
        windows=(int(window),) * config["num_hidden_layers"] if window else (),
        tied_head=bool(config.get("tie_word_embeddings", False)),
        logit_softcap=config.get("final_logit_softcapping"))
    generic.update(family)
    return DecoderVariant(**generic)


@dataclass(frozen=True)
class ModelFamily:
    """One family: the names its checkpoints carry and the variant a config gives.
    gguf_rope_permuted: llama.cpp stores this family's q and k rows permuted for its
    interleaved rope (its `llama` converter does; qwen2 / qwen3 use NeoX order and do not)."""

    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    variant: Callable[[dict], DecoderVariant]
    gguf_rope_permuted: bool = False
    gguf_names: Mapping[str, str] = field(default_factory=lambda: dict(LLAMA_GGUF_NAMES))


def _discover() -> dict[str, ModelFamily]:
    from . import families
    found: dict[str, ModelFamily] = {}
    for info in sorted(pkgutil.iter_modules(families.__path__), key=lambda i: i.name):
        family = getattr(importlib.import_module(f"{families.__name__}.{info.name}"),
                         "FAMILY", None)
        if isinstance(family, ModelFamily):
            found[family.name] = family
    return found


FAMILIES = _discover()


def supported_architectures() -> tuple[str, ...]:
    return tuple(a for f in FAMILIES.values() for a in f.architectures)


def family_for(config: dict) -> ModelFamily:
    """The family of a config.json: by its `architectures`, else by its `model_type`."""
    for arch in config.get("architectures") or ():
        for family in FAMILIES.values():
            if arch in family.architectures:
                return family
    model_type = config.get("model_type")
    for family in FAMILIES.values():
        if model_type in family.model_types:
            return family
    raise ValueError(f"unsupported architectures {config.get('architectures') or model_type}; "
                     f"supported: {', '.join(supported_architectures())}")
