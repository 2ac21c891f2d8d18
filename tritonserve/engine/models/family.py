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

import argparse
import importlib
import pkgutil
import re
import textwrap
from dataclasses import dataclass, field
from typing import Callable, Mapping

NORM_PLACEMENTS = ("pre", "post", "sandwich")
# config.json's hidden_act -> the gate's activation (gelu_tanh: GELU with the tanh
# approximation, what Gemma's gelu_pytorch_tanh computes)
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh",
               "gelu_tanh": "gelu_tanh"}
# rope_type -> how its inverse frequencies are made (engine/models/rope.py)
ROPE_KINDS = ("default", "llama3", "linear", "yarn", "longrope", "dynamic")

# llama.cpp's block tensor names -> the checkpoint's module names (gguf.py's hf_name)
LLAMA_GGUF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                    "ffn_down": "mlp.down_proj", "ffn_gate_exps": "mlp.experts.gate_proj",
                    "ffn_up_exps": "mlp.experts.up_proj",
                    "ffn_down_exps": "mlp.experts.down_proj"}


@dataclass(frozen=True)
class Rope:
    """One rope table's recipe: its base (theta), its kind (ROPE_KINDS) with the config's
    scaling fields (frozen as sorted items; lists as tuples), and the fraction of a head it
    rotates (partial_rotary_factor: the first fraction x head_dim dims)."""

    theta: float = 10000.0
    kind: str = "default"
    params: tuple[tuple[str, object], ...] = ()
    fraction: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ROPE_KINDS:
            raise ValueError(f"rope_type {self.kind!r} is not supported; supported: "
                             f"{', '.join(ROPE_KINDS)}")
        if not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"partial_rotary_factor {self.fraction} must be in (0, 1]")

    def get(self, name: str, default: object = None) -> object:
        return dict(self.params).get(name, default)


def rope_from(config: dict, rope: dict | None = None, theta: float | None = None) -> Rope:
    """The Rope a config describes: `rope` (a rope_parameters / rope_scaling dict; None: the
    config's own) with its base from the dict, `theta`, or the config's rope_theta. The
    original context length and partial_rotary_factor may sit at the config's top level
    (Phi-3's do); they are copied in."""
    if rope is None:
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope = dict(rope)
    kind = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
    rope.pop("type", None)
    base = rope.pop("rope_theta", None) or theta or config.get("rope_theta") or 10000.0
    fraction = rope.pop("partial_rotary_factor", None) or config.get(
        "partial_rotary_factor") or 1.0
    if kind != "default":
        rope.setdefault("original_max_position_embeddings", config.get(
            "original_max_position_embeddings") or config.get("max_position_embeddings"))
        rope.setdefault("max_position_embeddings", config.get("max_position_embeddings"))
    if kind == "su":  # Phi-3's first name for longrope
        kind = "longrope"
    params = tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                          for k, v in rope.items() if kind != "default"))
    return Rope(theta=float(base), kind=kind, params=params, fraction=float(fraction))


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts MLP (engine/models/moe.py): `count` experts of `intermediate`
    rows each, a router choosing `top_k` a token by softmax over all, then top-k (ties as
    torch.topk breaks them, as transformers does); normalize: the chosen weights divided by
    their sum (Mixtral always, Qwen3-MoE / OLMoE by norm_topk_prob). layers: which layers are
    sparse (() every one; a False layer keeps the dense MLP of intermediate_size: Qwen3-MoE's
    mlp_only_layers and decoder_sparse_step).
    gpt-oss's own: softmax_last (top-k of the raw logits, then a softmax over those k: its
    TopKRouter), bias (the router and every expert's gate / up / down carry biases), and
    swiglu_limit (the clamped SwiGLU: gate clamped above at the limit, up to [-limit, limit],
    out = (up + 1) * gate * sigmoid(swiglu_alpha * gate); None: silu(gate) * up)."""

    count: int
    top_k: int
    intermediate: int
    normalize: bool = True
    layers: tuple[bool, ...] = ()
    softmax_last: bool = False
    bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.count:
            raise ValueError(f"num_experts_per_tok {self.top_k} must be in [1, num_experts "
                             f"{self.count}]")

    @property
    def plain(self) -> bool:
        """Routed and computed as Mixtral / Qwen3-MoE: what the C++ and Triton expert ops
        take (the others run engine/models/moe.py's grouped_experts)."""
        return not (self.bias or self.swiglu_limit is not None)

    def sparse(self, layer: int) -> bool:
        return self.layers[layer] if self.layers else True


def experts_from(config: dict, normalize: bool | None = None) -> Experts:
    """The Experts of a MoE config.json: num_experts (num_local_experts: Mixtral's name, and
    the one transformers 5 writes for every family),
    num_experts_per_tok, moe_intermediate_size (else intermediate_size), norm_topk_prob
    unless the family fixes `normalize`, and Qwen's mlp_only_layers / decoder_sparse_step."""
    n = config["num_hidden_layers"]
    dense = set(config.get("mlp_only_layers") or ())
    step = int(config.get("decoder_sparse_step") or 1)
    layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(n))
    return Experts(
        count=int(config.get("num_experts") or config["num_local_experts"]),
        top_k=int(config["num_experts_per_tok"]),
        intermediate=int(config.get("moe_intermediate_size") or config["intermediate_size"]),
        normalize=bool(config.get("norm_topk_prob", False)) if normalize is None else normalize,
        layers=() if all(layers) else layers)


@dataclass(frozen=True)
class DecoderVariant:
    """How one model's decoder differs from Llama's; each default is Llama's.

    norm_placement: pre (norm, sublayer, add: Llama), post (sublayer, norm, add: OLMo 2),
      sandwich (norm, sublayer, norm, add: Gemma 2/3). norm_offset: each RMSNorm scales by
      offset + weight (Gemma stores weight - 1: offset 1.0), folded into the weight at load.
    activation: the gate's, silu or gelu_tanh. qk_norm: None, "head" (an RMSNorm over each
      head's q and k before rope: Qwen3, Gemma 3) or "full" (over the whole q and k
      projections: OLMo 2). qkv_bias: q, k and v carry biases (Qwen2).
    ropes: the rope tables; layer_ropes: each layer's index into them (None: that layer has
      no rope, SmolLM3's NoPE layers), () for ropes[0] everywhere (Gemma 3: a local and a
      global table).
    windows: an attention window per layer (None: the whole context), () for none at all;
      a query at position p sees the keys at positions (p - window, p].
    attention_scale: q.k's scale (None: head_dim ** -0.5; Gemma: query_pre_attn_scalar **
      -0.5, Granite: attention_multiplier). attn_softcap: scores become cap * tanh(s / cap)
      before the softmax (Gemma 2).
    residual_scale: each sublayer's output times this before it joins the stream (Granite's
      residual_multiplier). embedding_scale: the embedding's rows times this (Gemma:
      sqrt(hidden), Granite: embedding_multiplier), in the model's dtype.
    tied_head: the output layer is the embedding table. logit_scale: logits times this
      (Granite: 1 / logits_scaling); logit_softcap: then cap * tanh(logits / cap) (Gemma 2),
      None for none.
    experts: the MLP is a mixture of experts (Experts; None: dense).
    o_bias: the attention's output projection carries a bias (gpt-oss). sinks: each query
      head has a learned sink logit that joins its softmax's denominator and weighs no value
      (gpt-oss's attention sinks; the checkpoint's self_attn.sinks [num_heads])."""

    norm_placement: str = "pre"
    norm_offset: float = 0.0
    activation: str = "silu"
    qk_norm: str | None = None
    qkv_bias: bool = False
    ropes: tuple[Rope, ...] = (Rope(),)
    layer_ropes: tuple[int | None, ...] = ()
    windows: tuple[int | None, ...] = ()
    attention_scale: float | None = None
    attn_softcap: float | None = None
    residual_scale: float = 1.0
    embedding_scale: float = 1.0
    tied_head: bool = False
    logit_scale: float = 1.0
    logit_softcap: float | None = None
    experts: Experts | None = None
    o_bias: bool = False
    sinks: bool = False

    def __post_init__(self) -> None:
        checks = (("norm_placement", self.norm_placement, NORM_PLACEMENTS),
                  ("activation", self.activation, tuple(set(ACTIVATIONS.values()))),
                  ("qk_norm", self.qk_norm, (None, "head", "full")))
        for name, value, allowed in checks:
            if value not in allowed:
                raise ValueError(f"{name} {value!r} is not supported; supported: "
                                 f"{', '.join(map(str, allowed))}")
        bad = [i for i in self.layer_ropes if i is not None and not 0 <= i < len(self.ropes)]
        if bad:
            raise ValueError(f"layer_ropes name ropes {bad}; there are {len(self.ropes)}")

    def rope_of(self, layer: int) -> int | None:
        """Layer `layer`'s index into ropes (None: no rope)."""
        return self.layer_ropes[layer] if self.layer_ropes else 0

    def window_of(self, layer: int) -> int | None:
        return self.windows[layer] if self.windows else None

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
            ("a rope table per layer", len(set(self.layer_ropes) - {None}) > 1),
            ("layers without rope", None in self.layer_ropes),
            ("partial rotary", any(r.fraction < 1.0 for r in self.ropes)),
            ("an attention soft-cap", self.attn_softcap is not None),
            ("a residual multiplier", self.residual_scale != 1.0),
            ("an embedding scale", self.embedding_scale != 1.0),
            ("mixture of experts", self.experts is not None),
            ("an output projection bias", self.o_bias),
            ("attention sinks", self.sinks)) if odd]
        return ", ".join(differs) or None


def variant_from(config: dict, **family: object) -> DecoderVariant:
    """The variant the config's generic keys say (hidden_act, attention_bias,
    tie_word_embeddings, the rope and its scaling, sliding_window, the soft-caps), with the
    family's own fields over them. A sliding window here is every layer's; a family with a
    window per layer passes `windows` itself."""
    act = config.get("hidden_act") or config.get("hidden_activation") or "silu"
    if act not in ACTIVATIONS:
        raise ValueError(f"hidden_act {act!r} is not supported; supported: "
                         f"{', '.join(ACTIVATIONS)}")
    window = config.get("sliding_window")
    generic = dict(
        activation=ACTIVATIONS[act],
        qkv_bias=bool(config.get("attention_bias", False)),
        ropes=(rope_from(config),),
        windows=(int(window),) * config["num_hidden_layers"] if window else (),
        tied_head=bool(config.get("tie_word_embeddings", False)),
        attn_softcap=config.get("attn_logit_softcapping"),
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
    # the checkpoint stores q, k, v as one qkv_proj and gate, up as one gate_up_proj (Phi-3)
    fused_checkpoint: bool = False
    # checkpoint name prefixes read as others (a multimodal checkpoint's text tower), and
    # prefixes of tensors not read at all (its vision tower)
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    checkpoint_ignored: tuple[str, ...] = ()
    # regular-expression substitutions over the names, after the renames (Mixtral's
    # block_sparse_moe.experts.E.w1 -> mlp.experts.E.gate_proj)
    checkpoint_subs: tuple[tuple[str, str], ...] = ()
    # a checkpoint tensor (by its name after the subs) the family stores in its own layout ->
    # the decoder's tensors by name, or None for one read as it is (gpt-oss's stacked,
    # interleaved experts)
    checkpoint_split: Callable[[str, object], list | None] | None = None
    # GGUF: the files' general.architecture -> the checkpoint architecture; gguf_config adds
    # the family's own metadata keys to a converted config.json (engine/models/gguf_convert.py,
    # which converts the families that have one; the others go through transformers' GGUF
    # loader); gguf_norm_shift: what llama.cpp's converter added to every norm weight
    gguf_archs: Mapping[str, str] = field(default_factory=dict)
    gguf_config: Callable[[object, dict], None] | None = None
    gguf_norm_shift: float = 0.0
    # the file's expert tensors decide between families of one GGUF architecture (llama.cpp
    # writes Mixtral as `llama`): True for files with experts only, False without, None either
    gguf_experts: bool | None = None
    # a converted file's stacked experts written as transformers 5's fused gate_up_proj /
    # down_proj (moe.fused_experts); False keeps them stacked by projection (gpt-oss, whose
    # checkpoint's own gate_up_proj is another layout)
    gguf_fused_experts: bool = True

    def checkpoint_name(self, name: str) -> str | None:
        """A checkpoint tensor's name as the decoder's slots name it (None: not read)."""
        if name.startswith(self.checkpoint_ignored):
            return None
        for old, new in self.checkpoint_renames:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        for pattern, repl in self.checkpoint_subs:
            name = re.sub(pattern, repl, name)
        return name


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


def supported_gguf_architectures() -> tuple[str, ...]:
    """Each once (llama.cpp writes Llama and Mixtral as `llama`)."""
    return tuple(dict.fromkeys(a for f in FAMILIES.values() for a in f.gguf_archs))


def supported_models() -> str:
    """The line `serve --help` and `generate --help` end with."""
    return (f"supported models: {', '.join(supported_architectures())} (Hugging Face folders); "
            f"GGUF files of {', '.join(supported_gguf_architectures())}")


class HelpFormatter(argparse.HelpFormatter):
    """argparse's, except that a wrapped line never breaks inside a hyphenated name (the
    supported_models epilog's `gpt-oss`)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return textwrap.fill(" ".join(text.split()), width, initial_indent=indent,
                             subsequent_indent=indent, break_on_hyphens=False)


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
    named = ", ".join(config.get("architectures") or ()) or model_type
    raise ValueError(f"{named} is not supported (supported: "
                     f"{', '.join(supported_architectures())})")
