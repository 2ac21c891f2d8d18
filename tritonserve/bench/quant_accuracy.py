"""tritonserve bench quant-accuracy: what quantized weights cost in accuracy, as llama.cpp's
`perplexity --kl-divergence` reports it: over a text corpus, each quantized form's next-token
distribution against a reference form's, position by position. Mean KL(reference || form),
top-1 agreement, and both perplexities.

The corpus is text this repository ships (docs/architecture.md and README.md by default: a
few thousand tokens of English and code names), cut into windows of --window tokens; each
window is one prefill and its logits at every position are read (the engine's forward,
captured, then the lm_head over all rows).

Rows by default: the embedded model's GGUF blocks in fp32 against its fp32 conversion (an
exact format: KL at float rounding), and int8 / int4 quantized at load in bf16 against the
bf16 conversion. `--kv`: the int8 KV cache (--kv-cache-dtype int8) against the model's dtype's
cache, the same weights (the GGUF blocks in fp32, the bf16 conversion); every position's
attention reads the cache, its own row included.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from tritonserve.engine import LLMEngine, SamplingParams
from tritonserve.engine.llm import build_config

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CORPUS = (ROOT / "docs" / "architecture.md", ROOT / "README.md")
# (form, reference, dtype)
DEFAULT_ROWS = (("gguf", "none", "float32"), ("int8", "none", "bfloat16"),
                ("int4", "none", "bfloat16"), ("int4-g64", "none", "bfloat16"),
                ("int4-g128", "none", "bfloat16"))


# (weights, dtype): --kv's rows, int8 cache against the dtype's
KV_ROWS = (("gguf", "float32"), ("none", "bfloat16"))


def window_logprobs(model: str | None, quantization: str, dtype: str,
                    windows: list[list[int]], kv_cache_dtype: str = "auto") -> list[torch.Tensor]:
    """Per window, log-softmax of the logits at every position [T, V] (fp32)."""
    engine = LLMEngine(build_config(model, dtype=dtype, quantization=quantization,
                                    kv_cache_dtype=kv_cache_dtype,
                                    enable_prefix_caching=False, max_num_seqs=1,
                                    max_num_batched_tokens=max(len(w) for w in windows)))
    runner = engine.runner
    captured: list[torch.Tensor] = []
    forward = runner._forward

    def keep(model_input, ctx):
        hidden = forward(model_input, ctx)
        captured.append(hidden)
        return hidden

    runner._forward = keep
    out = []
    for i, window in enumerate(windows):
        captured.clear()
        engine.add_request(window, SamplingParams(temperature=0.0, max_tokens=1), f"w{i}")
        while engine.has_unfinished_requests():
            engine.step()
        hidden = captured[0]  # the prefill: every position
        with torch.inference_mode():
            logits = runner.weights.model_for(hidden.shape[0]).compute_logits(hidden).float()
        out.append(torch.log_softmax(logits, dim=-1))
    return out


def compare(reference: list[torch.Tensor], form: list[torch.Tensor],
            windows: list[list[int]]) -> dict[str, float]:
    kl, agree, count, nll_ref, nll_form = 0.0, 0, 0, 0.0, 0.0
    for ref, got, ids in zip(reference, form, windows):
        targets = torch.tensor(ids[1:])
        ref, got = ref[:-1], got[:-1]  # the last position predicts past the window
        kl += float((ref.exp() * (ref - got)).sum())
        agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
        nll_ref -= float(ref.gather(1, targets[:, None]).sum())
        nll_form -= float(got.gather(1, targets[:, None]).sum())
        count += len(targets)
    return {"kl": kl / count, "top1": agree / count, "ppl_ref": math.exp(nll_ref / count),
            "ppl": math.exp(nll_form / count), "tokens": count}


def greedy_differences(model: str | None, max_tokens: int = 64) -> None:
    """The conformance suite's probe prompts and the copy-edit set, as chat, greedy with the
    model's dtype's KV cache and with int8: which outputs differ, and from which token."""
    import json
    from tritonserve.bench.checks_native import PROBE_PROMPTS
    from tritonserve.engine.llm import LLM
    from tritonserve.engine.sampling_params import SamplingParams
    data = Path(__file__).parent / "data" / "copy_edit.jsonl"
    prompts = PROBE_PROMPTS + [json.loads(line)["prompt"] for line in data.read_text().split("\n")
                               if line.strip()]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs = {}
    for kv in ("auto", "int8"):
        llm = LLM(model, kv_cache_dtype=kv)
        chats = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                   add_generation_prompt=True, tokenize=False)
                 for p in prompts]
        outputs[kv] = [o.token_ids for o in llm.generate(chats, params)]
        del llm
    same = 0
    for i, (a, b) in enumerate(zip(outputs["auto"], outputs["int8"])):
        if a == b:
            same += 1
            continue
        first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        print(f"  prompt {i} ({prompts[i][:40]!r}...): differs from token {first} of {len(a)}")
    print(f"greedy, {max_tokens} tokens: {same} of {len(prompts)} outputs identical")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="tritonserve bench quant-accuracy")
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--corpus", nargs="+", type=Path, default=list(DEFAULT_CORPUS))
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--max-windows", type=int, default=24)
    ap.add_argument("--kv", action="store_true", help="the int8 KV cache's rows instead")
    args = ap.parse_args(argv)
    text = "\n\n".join(p.read_text() for p in args.corpus)
    engine = LLMEngine(build_config(args.model, dtype="float32", quantization="none",
                                    max_num_seqs=1))
    ids = engine.tokenize(text)
    del engine
    windows = [ids[i:i + args.window] for i in range(0, len(ids) - args.window + 1,
                                                     args.window)][:args.max_windows]
    print(f"corpus: {', '.join(p.name for p in args.corpus)}: {len(ids)} tokens, "
          f"{len(windows)} windows of {args.window}")
    print("| form | against | dtype | mean KL | top-1 agreement | perplexity (reference -> "
          "form) |")
    print("|---|---|---|---|---|---|")
    if args.kv:
        for weights, dtype in KV_ROWS:
            reference = window_logprobs(args.model, weights, dtype, windows)
            got = window_logprobs(args.model, weights, dtype, windows, kv_cache_dtype="int8")
            r = compare(reference, got, windows)
            print(f"| int8 KV cache | {dtype} KV cache, weights {weights} | {dtype} | "
                  f"{r['kl']:.2e} | {100 * r['top1']:.2f} % | {r['ppl_ref']:.3f} -> "
                  f"{r['ppl']:.3f} |", flush=True)
        greedy_differences(args.model)
        return 0
    references: dict[tuple[str, str], list[torch.Tensor]] = {}
    for form, against, dtype in DEFAULT_ROWS:
        key = (against, dtype)
        if key not in references:
            references[key] = window_logprobs(args.model, against, dtype, windows)
        got = window_logprobs(args.model, form, dtype, windows)
        r = compare(references[key], got, windows)
        print(f"| {form} | {against} | {dtype} | {r['kl']:.2e} | {100 * r['top1']:.2f} % | "
              f"{r['ppl_ref']:.3f} -> {r['ppl']:.3f} |", flush=True)
    return 0
