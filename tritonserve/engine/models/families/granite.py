"""Granite 3.x: Llama's decoder with four multipliers: the embedding's (embedding_multiplier),
each sublayer's output as it joins the stream (residual_multiplier), q.k's scale
(attention_multiplier, in place of head_dim ** -0.5) and the logits' (divided by
logits_scaling). Biases on the attention or MLP (attention_bias, mlp_bias) are not served."""
import gguf

from ..family import ModelFamily, variant_from


def granite_variant(config: dict):
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise ValueError(f"GraniteForCausalLM with {key}: true is not supported")
    return variant_from(
        config, embedding_scale=float(config.get("embedding_multiplier", 1.0)),
        residual_scale=float(config.get("residual_multiplier", 1.0)),
        attention_scale=float(config.get("attention_multiplier", 1.0)),
        logit_scale=1.0 / float(config.get("logits_scaling", 1.0)))


def granite_gguf_config(meta, config: dict) -> None:
    """The four multipliers, under llama.cpp's names (logit_scale divides, as
    logits_scaling does)."""
    keys = gguf.Keys
    for name, key in (("embedding_multiplier", keys.LLM.EMBEDDING_SCALE),
                      ("residual_multiplier", keys.LLM.RESIDUAL_SCALE),
                      ("attention_multiplier", keys.Attention.SCALE),
                      ("logits_scaling", keys.LLM.LOGIT_SCALE)):
        value = meta.get(key)
        if value is not None:
            config[name] = float(value)


FAMILY = ModelFamily(name="granite", architectures=("GraniteForCausalLM",),
                     model_types=("granite",), variant=granite_variant,
                     gguf_rope_permuted=True, gguf_archs={"granite": "GraniteForCausalLM"},
                     gguf_config=granite_gguf_config)
