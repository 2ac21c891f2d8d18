"""Peak host memory of building a model, against the size of its weights: the engine's
build_model (meta device, each parameter allocated once in the target dtype) and, for
comparison, the eager way (an fp32 model with random init, then cast).

tritonserve bench loading [--layers 16] [--hidden 2048] [--intermediate 8192]
    [--vocab 128256] [--dtype bfloat16]

Defaults: a Llama-3.2-1B-shaped model with dummy weights (~1.2 B parameters). Each build
runs in a fresh subprocess, so ru_maxrss is that build's own peak.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

_CHILD = """
import json, resource, sys, torch
from tritonserve.engine.models import ModelArch
from tritonserve.engine.models.decoder import DecoderForCausalLM
from tritonserve.engine.models.loader import build_model, init_dummy_weights
cfg, dtype, how = json.loads(sys.argv[1]), getattr(torch, sys.argv[2]), sys.argv[3]
arch = ModelArch.from_dict(cfg)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if how == "engine":
    model = build_model(arch, None, dtype, torch.device("cpu"), 4096, dummy=True)
else:
    model = DecoderForCausalLM(arch, 4096)
    init_dummy_weights(model)
    for p in model.parameters():
        p.data = p.data.to(dtype)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
weights = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"peak_kib": peak, "base_kib": base, "weights": weights,
                  "params": sum(p.numel() for p in model.parameters())}))
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tritonserve bench loading")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args(argv)
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": args.vocab,
           "hidden_size": args.hidden, "intermediate_size": args.intermediate,
           "num_hidden_layers": args.layers, "num_attention_heads": args.heads,
           "num_key_value_heads": args.kv_heads, "tie_word_embeddings": True}
    for how in ("engine", "eager"):
        out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(cfg), args.dtype, how],
                             capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        added = (r["peak_kib"] - r["base_kib"]) * 1024
        print(f"{how:<7} {r['params'] / 1e9:.2f} B params, {args.dtype} weights "
              f"{r['weights'] / 2**30:.2f} GiB; build peak RSS +{added / 2**30:.2f} GiB "
              f"({added / r['weights']:.2f}x the weights)")
    return 0
