"""Llama (1, 2, 3.x; SmolLM, SmolLM2): the reference decoder, every DecoderVariant default.
llama.cpp's converter stores q and k rows permuted for its interleaved rope."""
from ..family import ModelFamily, variant_from

FAMILY = ModelFamily(name="llama", architectures=("LlamaForCausalLM",),
                     model_types=("llama",), variant=variant_from, gguf_rope_permuted=True,
                     gguf_archs={"llama": "LlamaForCausalLM"}, gguf_experts=False)
