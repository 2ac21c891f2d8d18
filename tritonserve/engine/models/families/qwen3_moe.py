"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k norms per head), and a
mixture-of-experts MLP: top-8 of 128 experts of moe_intermediate_size rows, the chosen
weights renormalised (norm_topk_prob), a dense MLP on the layers mlp_only_layers names. No
shared expert. llama.cpp writes it as `qwen3moe` with the experts stacked
(ffn_gate_exps / ffn_up_exps / ffn_down_exps) and the router as ffn_gate_inp."""
from ..family import ModelFamily, experts_from, variant_from
from .qwen2 import qwen_windows

FAMILY = ModelFamily(
    name="qwen3_moe", architectures=("Qwen3MoeForCausalLM",), model_types=("qwen3_moe",),
    variant=lambda config: variant_from(config, qk_norm="head", windows=qwen_windows(config),
                                        experts=experts_from(config)),
    # llama.cpp's graph for the architecture fixes whether the weights are renormalised
    gguf_config=lambda meta, config: config.setdefault("norm_topk_prob", True),
    gguf_archs={"qwen3moe": "Qwen3MoeForCausalLM"})
