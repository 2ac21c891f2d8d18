"""tritonserve bench {throughput,profile,kernels,serve,conformance,grammar,loading,
    engine-check,compile-probe,cpu-decode,cpu-linear,quant-accuracy,ab-trees,tp-cost,
    bound,gguf-table,hostile,model-shape,priority,embed-share,lora,long-context,
    prefix-restart} ..."""
from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "throughput": "tritonserve.bench.throughput",
    "profile": "tritonserve.bench.profile_step",
    "kernels": "tritonserve.bench.kernels",
    "serve": "tritonserve.bench.serve",
    "conformance": "tritonserve.bench.conformance",
    "grammar": "tritonserve.bench.grammar",
    "loading": "tritonserve.bench.loading",
    "engine-check": "tritonserve.bench.engine_check",
    "compile-probe": "tritonserve.bench.compile_probe",
    "cpu-decode": "tritonserve.bench.cpu_decode",
    "cpu-linear": "tritonserve.bench.cpu_linear",
    "quant-accuracy": "tritonserve.bench.quant_accuracy",
    "ab-trees": "tritonserve.bench.ab_trees",
    "tp-cost": "tritonserve.bench.tp_cost",
    "bound": "tritonserve.bench.bound",
    "gguf-table": "tritonserve.bench.gguf_table",
    "hostile": "tritonserve.bench.hostile",
    "model-shape": "tritonserve.bench.model_shape",
    "priority": "tritonserve.bench.priority",
    "embed-share": "tritonserve.bench.embed_share",
    "lora": "tritonserve.bench.lora",
    "long-context": "tritonserve.bench.long_context",
    "prefix-restart": "tritonserve.bench.prefix_restart",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: tritonserve bench {{{','.join(COMMANDS)}}} [options]", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[argv[0]])
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
