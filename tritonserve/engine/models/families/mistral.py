"""Mistral: Llama's decoder; `sliding_window` (null when off) is every layer's window."""
from ..family import ModelFamily, variant_from

FAMILY = ModelFamily(name="mistral", architectures=("MistralForCausalLM",),
                     model_types=("mistral",), variant=variant_from, gguf_rope_permuted=True)
