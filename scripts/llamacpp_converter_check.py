"""Each family's tiny random checkpoint through llama.cpp's own convert_hf_to_gguf.py, served by
us from the file: greedy tokens against transformers on the folder (F32: identical) and
against llama.cpp itself on the same file (with llama-cpp-python). A dev check, not CI: it
needs llama.cpp's source tree (llama-cpp-python's sdist carries one under vendor/llama.cpp),
sentencepiece for the converter (Gemma 2 and Phi-3 checkpoints carry tokenizer.model) and,
for the last column, llama-cpp-python in its own venv (docs/peers.md).

    .venv/bin/pip download --no-deps --no-binary :all: llama-cpp-python -d /tmp/src
    .venv/bin/pip install --target /tmp/sp sentencepiece
    .venv/bin/python scripts/llamacpp_converter_check.py --llama-cpp /tmp/src/.../vendor/llama.cpp \
        --sentencepiece /tmp/sp [--outtype q8_0] [--llama-python /tmp/llama-venv/bin/python]

The tiny checkpoints take what a GGUF file can say (tests/test_families_parity.py's
GGUF_OVERRIDES: Gemma's q.k scale is the head size's, SmolLM3's NoPE layers every fourth) and
a tokenizer llama.cpp's converter knows: SmolLM2's (its `smollm` pre-tokenizer), or for the
families whose converter wants tokenizer.model a sentencepiece BPE trained here."""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.parity import Reference, assert_parity, hf_greedy  # noqa: E402
from tests.test_families_parity import GGUF_OVERRIDES  # noqa: E402
from tests.tiny_models import write_tiny_model  # noqa: E402

FAMILIES = ["LlamaForCausalLM", "Gemma3ForCausalLM", "Gemma2ForCausalLM", "Phi3ForCausalLM",
            "GraniteForCausalLM", "Olmo2ForCausalLM", "SmolLM3ForCausalLM"]
SENTENCEPIECE = ("Gemma2ForCausalLM", "Phi3ForCausalLM")
LLAMA_CPP_GREEDY = """
import json, sys
import numpy as np
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=512, n_threads=2, verbose=False, logits_all=True)
res = []
for p in json.loads(sys.argv[2]):
    llm.reset(); llm.eval(p); toks, gaps = [], []
    for _ in range(32):
        logits = np.array(llm.scores[llm.n_tokens - 1]); top = np.argsort(logits)[::-1][:2]
        toks.append(int(top[0])); gaps.append(float(logits[top[0]] - logits[top[1]]))
        llm.eval([int(top[0])])
    res.append([toks, gaps])
print("JSON" + json.dumps(res))
"""


def sentencepiece_model(work: Path, sp_path: str) -> Path:
    sys.path.insert(0, sp_path)
    import sentencepiece as spm
    words = ("paged attention block token stream the quick brown fox jumps over lazy dog "
             "schedule cache hello world kernel triton decode prefill sample").split()
    rng = random.Random(0)
    corpus = work / "corpus.txt"
    corpus.write_text("\n".join(" ".join(rng.choice(words) for _ in range(12))
                                for _ in range(3000)))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(work / "sp"),
                                   vocab_size=384, model_type="bpe", bos_id=2, eos_id=1,
                                   pad_id=0, unk_id=3, byte_fallback=True,
                                   character_coverage=1.0, minloglevel=2)
    return work / "sp.model"


def checkpoint(arch: str, folder: Path, sp_model: Path) -> None:
    from tritonserve.engine.default_model import default_model_path
    extra = GGUF_OVERRIDES.get(arch, {})
    if arch in SENTENCEPIECE:
        write_tiny_model(folder, arch, vocab_size=384, eos_token_id=1, bos_token_id=2,
                         pad_token_id=0, **extra)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            (folder / name).unlink(missing_ok=True)
        shutil.copy(sp_model, folder / "tokenizer.model")
        return
    write_tiny_model(folder, arch, vocab_size=49152, **extra)
    source = Path(default_model_path())
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(source / name, folder / name)


def main() -> int:
    parser = argparse.ArgumentParser(prog="llamacpp_converter_check")
    parser.add_argument("--llama-cpp", required=True, help="llama.cpp's source tree")
    parser.add_argument("--sentencepiece", required=True, help="a folder with sentencepiece")
    parser.add_argument("--outtype", default="f32", choices=["f32", "q8_0", "bf16"])
    parser.add_argument("--llama-python", default=None, help="a python with llama_cpp")
    parser.add_argument("--families", default=",".join(FAMILIES))
    args = parser.parse_args()
    from tritonserve.engine import LLM, SamplingParams

    work = Path(tempfile.mkdtemp(prefix="converter-check-"))
    sp_model = sentencepiece_model(work, args.sentencepiece)
    failed = 0
    for arch in args.families.split(","):
        folder = work / arch
        checkpoint(arch, folder, sp_model)
        out = work / f"{arch}.{args.outtype}.gguf"
        conv = subprocess.run([sys.executable, f"{args.llama_cpp}/convert_hf_to_gguf.py",
                               str(folder), "--outfile", str(out), "--outtype", args.outtype],
                              capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": args.sentencepiece})
        if conv.returncode:
            print(f"{arch}: the converter failed: {conv.stderr.strip().splitlines()[-1]}")
            failed += 1
            continue
        llm = LLM(str(out), dtype="float32", decode_mode="eager")
        prompts = [llm.tokenizer.encode("The quick brown fox jumps over the lazy dog " * k)
                   for k in (1, 3)]
        ours = [o.token_ids for o in llm.generate(
            prompts, SamplingParams(temperature=0.0, max_tokens=32))]
        tie = 1e-4 if args.outtype == "f32" else 0.05
        verdicts = []
        refs = {"transformers": hf_greedy(str(folder), prompts, 32,
                                          set(llm.engine.eos_token_ids))}
        if args.llama_python:
            run = subprocess.run([args.llama_python, "-c", LLAMA_CPP_GREEDY, str(out),
                                  json.dumps(prompts)], capture_output=True, text=True)
            if "JSON" in run.stdout:
                eos = set(llm.engine.eos_token_ids)
                refs["llama.cpp"] = []
                for tokens, gaps in json.loads(run.stdout.split("JSON", 1)[1]):
                    cut = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
                    refs["llama.cpp"].append(Reference(tokens[:cut], gaps[:cut]))
            else:
                verdicts.append(f"llama.cpp failed: {run.stderr.strip()[-200:]}")
        for name, ref in refs.items():
            try:
                ties = assert_parity(ours, ref, tie_gap=tie)
                verdicts.append(f"{name}: same" + (f" ({'; '.join(ties)})" if ties else ""))
            except AssertionError as exc:
                failed += 1
                verdicts.append(f"{name}: DIFFERS ({str(exc).splitlines()[0]})")
        print(f"{arch} {args.outtype} (weights {llm.engine.runner.plan.weights}): "
              + "; ".join(verdicts))
    shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
