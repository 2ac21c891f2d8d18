"""A PEFT adapter through llama.cpp's own convert_lora_to_gguf.py, served by us from the file:
the parts read from each outtype's file against the PEFT folder's, and greedy tokens of the
F32 file against the folder's and transformers' on peft's merged model. A dev check, not CI:
it needs llama.cpp's source tree (llama-cpp-python's sdist carries one under vendor/llama.cpp).

    .venv/bin/pip download --no-deps --no-binary :all: llama-cpp-python -d /tmp/src
    .venv/bin/python scripts/llamacpp_lora_check.py --llama-cpp /tmp/src/.../vendor/llama.cpp
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.parity import hf_greedy  # noqa: E402
from tests.test_engine_parity import mixed_prompts  # noqa: E402
from tests.test_lora import make_adapter  # noqa: E402
from tests.tiny_models import write_tiny_model  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--llama-cpp", required=True, help="llama.cpp's source tree")
    args = p.parse_args()
    from tritonserve.engine import LLM, SamplingParams
    tree = Path(args.llama_cpp)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        base = write_tiny_model(folder / "base")
        adapter, merged = make_adapter(str(base), folder, 1, 8)
        files = {}
        for outtype in ("f32", "bf16", "q8_0"):
            files[outtype] = folder / f"adapter-{outtype}.gguf"
            subprocess.run([sys.executable, str(tree / "convert_lora_to_gguf.py"), "--base",
                            str(base), "--outfile", str(files[outtype]), "--outtype", outtype,
                            adapter], check=True, cwd=tree, capture_output=True,
                           env={**os.environ, "PYTHONPATH": str(tree / "gguf-py")})
        llm = LLM(str(base), dtype="float32", lora_modules=(
            f"peft={adapter}", *(f"{t}={f}" for t, f in files.items())))
        peft = llm.engine.loras["peft"].parts
        for outtype in files:
            parts = llm.engine.loras[outtype].parts
            gap = max(max(((want - got).abs().max() / want.abs().max()).item()
                          for want, got in ((w.a, g.a), (w.b, g.b)))
                      for key in peft for w, g in zip(peft[key], parts[key], strict=True))
            print(f"{outtype}: parts within {gap:.2g} of the PEFT folder's (relative)")
        prompts = mixed_prompts(llm.tokenizer, count=4, seed=6)
        greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
        tokens = {name: [o.token_ids for o in llm.generate(prompts, greedy, lora=name)]
                  for name in ("peft", *files)}
        refs = hf_greedy(merged, prompts, 32, set(llm.engine.eos_token_ids))
        print("F32 file == PEFT folder:", tokens["f32"] == tokens["peft"])
        print("PEFT folder == transformers on peft's merged model:",
              tokens["peft"] == [r.token_ids for r in refs])
        for outtype in ("bf16", "q8_0"):
            same = sum(a == b for a, b in zip(tokens[outtype], tokens["peft"]))
            print(f"{outtype}: {same} of {len(prompts)} prompts' 32 tokens equal to the folder's")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
