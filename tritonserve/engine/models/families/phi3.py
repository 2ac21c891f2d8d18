"""Phi-3 / Phi-3.5 / Phi-4-mini: Llama's decoder with q, k, v stored as one qkv_proj and gate,
up as one gate_up_proj; longrope (`su` in early configs) with its short and long factors and
the original context at the config's top level; partial rotary (Phi-4-mini: 0.75); an
optional sliding window on every layer. llama.cpp stores them fused too (attn_qkv, ffn_up
holding gate and up) and unpermuted."""
import gguf

from ..family import ModelFamily, variant_from


def phi3_gguf_config(meta, config: dict) -> None:
    """llama.cpp's Phi-3 converter stores longrope's factors as two tensors beside the
    original context and the attention factor it computed."""
    config["hidden_act"] = "silu"
    window = meta.get(gguf.Keys.Attention.SLIDING_WINDOW)
    config["sliding_window"] = int(window) if window else None
    long, short = meta.vector("rope_factors_long.weight"), meta.vector("rope_factors_short.weight")
    if long is not None and short is not None:
        original = int(meta.get(gguf.Keys.Rope.SCALING_ORIG_CTX_LEN))
        config["original_max_position_embeddings"] = original
        config["rope_scaling"] = {"rope_type": "longrope", "long_factor": long,
                                  "short_factor": short,
                                  "original_max_position_embeddings": original}
        factor = meta.get(gguf.Keys.Rope.SCALING_ATTN_FACTOR)
        if factor is not None:
            config["rope_scaling"]["attention_factor"] = float(factor)

FAMILY = ModelFamily(
    name="phi3", architectures=("Phi3ForCausalLM",), model_types=("phi3",),
    variant=variant_from, fused_checkpoint=True,
    gguf_names={"attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
                "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"},
    gguf_archs={"phi3": "Phi3ForCausalLM"}, gguf_config=phi3_gguf_config)
