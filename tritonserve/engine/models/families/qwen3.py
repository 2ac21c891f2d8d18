"""Qwen3 (dense): Llama's decoder with an RMSNorm over each head's q and k before rope, no
biases (unless `attention_bias`); windows as Qwen2's."""
from ..family import ModelFamily, variant_from
from .qwen2 import qwen_windows

FAMILY = ModelFamily(
    name="qwen3", architectures=("Qwen3ForCausalLM",), model_types=("qwen3",),
    variant=lambda config: variant_from(config, qk_norm="head", windows=qwen_windows(config)),
    gguf_archs={"qwen3": "Qwen3ForCausalLM"})
