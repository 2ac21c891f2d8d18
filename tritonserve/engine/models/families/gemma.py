"""Gemma 2 and Gemma 3 (text; the text tower of Gemma3ForConditionalGeneration too): (1 + w)
RMSNorms, four a layer (pre/post attention, pre/post MLP), GeGLU with tanh-GELU, embeddings
scaled by sqrt(hidden), q.k scaled by query_pre_attn_scalar ** -0.5, sliding-window layers
between global ones, a tied head. Gemma 3 adds q/k norms and a rope table for each kind of
layer (local: rope_local_base_freq, unscaled; global: rope_theta with the config's scaling);
Gemma 2 adds the attention and logit soft-caps (the generic config keys). llama.cpp's
converter stores the norms as 1 + w (transformers' GGUF loader takes the 1 off again) and
leaves q and k unpermuted."""
import gguf

from ..family import ModelFamily, Rope, rope_from, variant_from


def layer_kinds(config: dict, default_pattern: int) -> list[str]:
    """Each layer's "sliding_attention" or "full_attention": config.json's layer_types, else
    every `sliding_window_pattern`-th layer global (Gemma 3's 5:1 is 6, Gemma 2's 1:1 is 2)."""
    n = config["num_hidden_layers"]
    kinds = config.get("layer_types")
    if kinds:
        return list(kinds)
    pattern = config.get("sliding_window_pattern") or default_pattern
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(n)]


def gemma_variant(config: dict, gemma3: bool):
    kinds = layer_kinds(config, 6 if gemma3 else 2)
    window = config.get("sliding_window")
    fields = dict(
        norm_placement="sandwich", norm_offset=1.0,
        windows=tuple(int(window) if k == "sliding_attention" and window else None
                      for k in kinds),
        attention_scale=float(config.get("query_pre_attn_scalar") or config["head_dim"]) ** -0.5,
        embedding_scale=float(config["hidden_size"]) ** 0.5,
        tied_head=bool(config.get("tie_word_embeddings", True)))
    if gemma3:
        rope = config.get("rope_parameters") or {}
        if "full_attention" in rope:  # transformers 5: a rope per kind of layer
            ropes = (rope_from(config, rope["full_attention"]),
                     rope_from(config, rope["sliding_attention"]))
        else:
            ropes = (rope_from(config), Rope(theta=float(config.get("rope_local_base_freq")
                                                         or 10000.0)))
        fields.update(qk_norm="head", ropes=ropes,
                      layer_ropes=tuple(1 if k == "sliding_attention" else 0 for k in kinds))
    return variant_from(config, **fields)


def gemma_gguf_config(meta, config: dict) -> None:
    """What llama.cpp's Gemma converters write and its loader assumes: the window, Gemma 2's
    soft-caps, q.k scaled by the head size (by hidden / heads for the 27B shapes: 46 layers
    for Gemma 2, 62 for Gemma 3), every sixth layer global for Gemma 3, every second for
    Gemma 2, Gemma 3's local rope base (10,000 unless the file says)."""
    gemma3 = meta.arch == "gemma3"
    config["model_type"] = "gemma3_text" if gemma3 else "gemma2"
    config["hidden_activation"] = "gelu_pytorch_tanh"
    big = config["num_hidden_layers"] == (62 if gemma3 else 46)
    config["query_pre_attn_scalar"] = (config["hidden_size"] // config["num_attention_heads"]
                                       if big else config["head_dim"])
    config["sliding_window"] = meta.get(gguf.Keys.Attention.SLIDING_WINDOW)
    pattern = meta.get(gguf.Keys.Attention.SLIDING_WINDOW_PATTERN)
    if isinstance(pattern, list):  # a flag a layer: sliding or not
        config["layer_types"] = ["sliding_attention" if p else "full_attention"
                                 for p in pattern]
    else:
        config["sliding_window_pattern"] = int(pattern or (6 if gemma3 else 2))
    if gemma3:
        config["rope_local_base_freq"] = float(meta.get(gguf.Keys.Rope.FREQ_BASE_SWA, 10000.0))
    else:
        config["attn_logit_softcapping"] = meta.get(gguf.Keys.LLM.ATTN_LOGIT_SOFTCAPPING)
        config["final_logit_softcapping"] = meta.get(gguf.Keys.LLM.FINAL_LOGIT_SOFTCAPPING)


FAMILY = ModelFamily(
    name="gemma", architectures=("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration",
                                 "Gemma2ForCausalLM"),
    model_types=("gemma3_text", "gemma3", "gemma2"),
    variant=lambda config: gemma_variant(config, config.get("model_type") != "gemma2"),
    checkpoint_renames=(("model.language_model.", "model."),
                        ("language_model.model.", "model."),
                        ("language_model.lm_head.", "lm_head.")),
    checkpoint_ignored=("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                        "model.multi_modal_projector."),
    gguf_archs={"gemma3": "Gemma3ForCausalLM", "gemma2": "Gemma2ForCausalLM"},
    gguf_config=gemma_gguf_config, gguf_norm_shift=1.0)
