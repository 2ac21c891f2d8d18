"""Mixtral (8x7B, 8x22B): Mistral's decoder with a mixture-of-experts MLP, top-2 of 8, the
two weights renormalised; the checkpoint names the block block_sparse_moe and an expert's
gate / down / up w1 / w2 / w3 (read here as Qwen-MoE's names). llama.cpp writes it as a
`llama` file with stacked expert tensors (engine/models/gguf_convert.py tells them apart by
llama.expert_count)."""
from ..family import ModelFamily, experts_from, variant_from

FAMILY = ModelFamily(
    name="mixtral", architectures=("MixtralForCausalLM",), model_types=("mixtral",),
    variant=lambda config: variant_from(
        config, experts=experts_from(config, normalize=True)),
    gguf_rope_permuted=True, gguf_archs={"llama": "MixtralForCausalLM"}, gguf_experts=True,
    gguf_config=lambda meta, config: config.setdefault("norm_topk_prob", True),
    checkpoint_subs=((r"\.block_sparse_moe\.", ".mlp."),
                     (r"\.experts\.(\d+)\.w1\.", r".experts.\1.gate_proj."),
                     (r"\.experts\.(\d+)\.w2\.", r".experts.\1.down_proj."),
                     (r"\.experts\.(\d+)\.w3\.", r".experts.\1.up_proj.")))
