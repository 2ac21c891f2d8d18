"""Qwen2 / Qwen2.5: Llama's decoder with biases on q, k and v. Its `sliding_window` counts
only when `use_sliding_window` is true, and then for the layers from `max_window_layers` on."""
from ..family import ModelFamily, variant_from


def qwen_windows(config: dict) -> tuple[int | None, ...]:
    """Qwen2's and Qwen3's window per layer (shared by qwen3.py)."""
    window = config.get("sliding_window")
    if not (window and config.get("use_sliding_window")):
        return ()
    first = config.get("max_window_layers") or 0
    return tuple(int(window) if i >= first else None
                 for i in range(config["num_hidden_layers"]))


FAMILY = ModelFamily(
    name="qwen2", architectures=("Qwen2ForCausalLM",), model_types=("qwen2",),
    variant=lambda config: variant_from(config, qkv_bias=True, windows=qwen_windows(config)),
    gguf_archs={"qwen2": "Qwen2ForCausalLM"})
