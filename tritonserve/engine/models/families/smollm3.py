"""SmolLM3: Llama's decoder where some layers have no rope (no_rope_layers[i] is 0 for those:
every fourth by default, NoPE), a tied head, windows as Qwen2's."""
from ..family import ModelFamily, variant_from
from .qwen2 import qwen_windows


def smollm3_variant(config: dict):
    n = config["num_hidden_layers"]
    uses = config.get("no_rope_layers") or [
        int((i + 1) % (config.get("no_rope_layer_interval") or 4) != 0) for i in range(n)]
    return variant_from(config, layer_ropes=tuple(0 if use else None for use in uses),
                        windows=qwen_windows(config),
                        tied_head=bool(config.get("tie_word_embeddings", True)))


def smollm3_gguf_config(meta, config: dict) -> None:
    """llama.cpp's loader takes every fourth layer as NoPE (its files carry no key)."""
    config["no_rope_layer_interval"] = 4


FAMILY = ModelFamily(name="smollm3", architectures=("SmolLM3ForCausalLM",),
                     model_types=("smollm3",), variant=smollm3_variant,
                     gguf_rope_permuted=True, gguf_archs={"smollm3": "SmolLM3ForCausalLM"},
                     gguf_config=smollm3_gguf_config)
