"""OLMoE (OLMoE-1B-7B): Llama's pre-norm layer with an RMSNorm over the whole q and k
projections (OLMo 2's), and a mixture-of-experts MLP, top-8 of 64, the chosen weights not
renormalised unless norm_topk_prob says so. llama.cpp writes it as `olmoe`."""
from ..family import ModelFamily, experts_from, variant_from

FAMILY = ModelFamily(
    name="olmoe", architectures=("OlmoeForCausalLM",), model_types=("olmoe",),
    variant=lambda config: variant_from(config, qk_norm="full", experts=experts_from(config)),
    # llama.cpp's graph for the architecture fixes whether the weights are renormalised
    gguf_config=lambda meta, config: config.setdefault("norm_topk_prob", False),
    gguf_archs={"olmoe": "OlmoeForCausalLM"})
