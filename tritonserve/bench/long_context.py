"""tritonserve bench long-context: one stream's time per output token (TPOT) by context length.

For each --contexts length N: one request of N token ids (drawn at random from the vocabulary,
fixed seed) decodes --tokens tokens greedily, alone in the engine; its decode steps' median is
the TPOT at that context, its prefill time is printed beside. The target (issue "Long
context"): TPOT at 8k <= 2x TPOT at 128. Engine-level (no HTTP): what the attention costs as the
context grows, nothing else. Options are the engine's (`--model`, `--dtype`, ...: any
build_config key as --key value).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from tritonserve.engine.llm import LLM
from tritonserve.engine.sampling_params import SamplingParams


def run(llm: LLM, contexts: list[int], tokens: int, seed: int = 0) -> list[dict]:
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
        engine.add_request(ids, SamplingParams(max_tokens=tokens, temperature=0.0,
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tritonserve bench long-context")
    p.add_argument("--model", default=None, help="default: the embedded model")
    p.add_argument("--contexts", default="128,1024,4096,8000")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--json", default=None)
    args, rest = p.parse_known_args(argv)
    options = {}
    for key, value in zip(rest[::2], rest[1::2]):
        options[key.lstrip("-").replace("-", "_")] = int(value) if value.isdigit() else value
    llm = LLM(args.model, **options)
    rows = run(llm, [int(c) for c in args.contexts.split(",")], args.tokens)
    base = rows[0]["tpot_ms"]
    print(f"{'context':>8} {'TPOT ms':>8} {'x first':>8} {'prefill s':>10}")
    for row in rows:
        print(f"{row['context']:>8} {row['tpot_ms']:>8.2f} {row['tpot_ms'] / base:>7.2f}x "
              f"{row['prefill_s']:>10.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0
