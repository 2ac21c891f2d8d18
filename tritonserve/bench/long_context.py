"""tritonserve bench long-context: one stream's time per output token (TPOT) by context length.

For each --contexts length N: one request of N token ids (drawn at random from the vocabulary,
fixed seed) decodes --tokens tokens (greedy, or the default sampling with --default-sampling),
alone in the engine; its decode steps' median is
the TPOT at that context, its prefill time is printed beside. The target (issue "Long
context"): TPOT at 8k <= 2x TPOT at 128. Engine-level (no HTTP): what the attention costs as the
context grows, nothing else. Options are the engine's (`--model`, `--dtype`, ...: any
build_config key as --key value).

`--beside N --prompt P`: instead, N streams decode (64-token prompts) and a prompt of P tokens
arrives: its TTFT, and the streams' gaps between tokens while it prefills (every step gives
each stream a token) against their TPOT before it came; with `--long-prefill-tokens` (the
scheduler's knob) the trade-off between the two.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from tritonserve.engine.llm import LLM
from tritonserve.engine.sampling_params import SamplingParams


def run(llm: LLM, contexts: list[int], tokens: int, seed: int = 0,
        temperature: float = 0.0) -> list[dict]:
    engine, rows = llm.engine, []
    vocab = engine.arch.vocab_size
    rng = random.Random(seed)
    # a first request, not reported: the first after start pays one-time costs (its 128-token
    # TPOT read 9-10.6 ms against 7.6 for the next)
    engine.add_request([rng.randrange(100, vocab) for _ in range(128)],
                       SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    for n in contexts:
        ids = [rng.randrange(100, vocab) for _ in range(n)]
        engine.add_request(ids, SamplingParams(max_tokens=tokens, temperature=temperature,
                                               ignore_eos=True))
        times = []
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        decode = times[-(tokens - 1):]  # the steps after the one that drew the first token
        rows.append({"context": n, "tpot_ms": statistics.median(decode) * 1e3,
                     "prefill_s": sum(times[:-(tokens - 1)])})
    return rows


def beside(llm: LLM, prompt: int, streams: int, seed: int = 0) -> dict:
    """N decoding streams, then one prompt of `prompt` tokens: its TTFT and the streams' gaps."""
    engine = llm.engine
    vocab = engine.arch.vocab_size
    rng = random.Random(seed)
    draw = lambda n: [rng.randrange(100, vocab) for _ in range(n)]  # noqa: E731
    long_params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.add_request(draw(128), long_params)  # warm-up, not reported
    while engine.has_unfinished_requests():
        engine.step()
    longest = min(2000, engine.max_model_len - 64)  # the streams outlast the prefill
    ids = [engine.add_request(draw(64), SamplingParams(max_tokens=longest, temperature=0.0,
                                                       ignore_eos=True))
           for _ in range(streams)]
    alone = []
    for _ in range(12):  # the streams' prompts, then their decode steps alone
        start = time.perf_counter()
        engine.step()
        alone.append(time.perf_counter() - start)
    long_id = engine.add_request(draw(prompt), long_params)
    arrived, gaps, ttft = time.perf_counter(), [], None
    while ttft is None:
        start = time.perf_counter()
        steps = engine.step()
        gaps.append(time.perf_counter() - start)
        if any(s.request_id == long_id and s.token is not None for s in steps):
            ttft = time.perf_counter() - arrived
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return {"prompt": prompt, "streams": streams, "ttft_s": ttft, "steps": len(gaps),
            "tpot_alone_ms": statistics.median(alone[-8:]) * 1e3,
            "gap_median_ms": statistics.median(gaps) * 1e3, "gap_max_ms": max(gaps) * 1e3}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tritonserve bench long-context")
    p.add_argument("--model", default=None, help="default: the embedded model")
    p.add_argument("--contexts", default="128,1024,4096,8000")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--json", default=None)
    p.add_argument("--default-sampling", action="store_true",
                   help="SamplingParams' defaults (temperature 1) instead of greedy")
    p.add_argument("--beside", type=int, default=0, help="N streams decoding beside --prompt")
    p.add_argument("--prompt", type=int, default=8000)
    args, rest = p.parse_known_args(argv)
    options = {}
    for key, value in zip(rest[::2], rest[1::2]):
        options[key.lstrip("-").replace("-", "_")] = int(value) if value.isdigit() else value
    llm = LLM(args.model, **options)
    if args.beside:
        r = beside(llm, args.prompt, args.beside)
        print(f"{r['streams']} streams, then a {r['prompt']}-token prompt: TTFT {r['ttft_s']:.2f} s "
              f"over {r['steps']} steps; the streams' TPOT alone {r['tpot_alone_ms']:.1f} ms, "
              f"their gaps while it prefilled: median {r['gap_median_ms']:.0f} ms, max "
              f"{r['gap_max_ms']:.0f} ms")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(r, f, indent=2)
        return 0
    temperature = SamplingParams().temperature if args.default_sampling else 0.0
    rows = run(llm, [int(c) for c in args.contexts.split(",")], args.tokens,
               temperature=temperature)
    base = rows[0]["tpot_ms"]
    print(f"{'context':>8} {'TPOT ms':>8} {'x first':>8} {'prefill s':>10}")
    for row in rows:
        print(f"{row['context']:>8} {row['tpot_ms']:>8.2f} {row['tpot_ms'] / base:>7.2f}x "
              f"{row['prefill_s']:>10.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0
