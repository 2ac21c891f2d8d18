"""OLMo 2: norms after the attention and after the MLP (the sublayer's output normed, then
added), and an RMSNorm over the whole q and the whole k projection before rope."""
from ..family import ModelFamily, variant_from

FAMILY = ModelFamily(
    name="olmo2", architectures=("Olmo2ForCausalLM",), model_types=("olmo2",),
    variant=lambda config: variant_from(config, norm_placement="post", qk_norm="full"),
    gguf_archs={"olmo2": "Olmo2ForCausalLM"},
    gguf_config=lambda meta, config: None)  # the generic keys say it all
