"""What structured output costs a decode step: the grammar bitmask of a full batch, filled
and applied to [B, V] logits, against a plain step's sampling.

tritonserve bench grammar [--model PATH] [--batch 64] [--repeats 20]

Each of the batch's matchers is first walked through a different prefix of a realistic JSON
answer, so the fills see the states a real batch is in (inside keys, strings, numbers).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tritonserve bench grammar")
    p.add_argument("--model", default=None, help="local HF folder (default: embedded SmolLM2)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)

    from transformers import AutoConfig, AutoTokenizer

    from tritonserve.engine.cpu_allocator import keep_buffers_on_heap
    from tritonserve.engine.default_model import default_model_path
    from tritonserve.engine.structured import Grammars, StructuredOutput, TokenBitmask
    keep_buffers_on_heap()  # as the engine does on the CPU
    folder = args.model or str(default_model_path())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    vocab = AutoConfig.from_pretrained(folder).vocab_size
    grammars = Grammars(tokenizer, vocab, [tokenizer.eos_token_id])
    answer = json.dumps({"name": "Ada Lovelace", "born": 1815, "languages": ["English",
                         "French"], "notes": {"field": "mathematics", "first_program": True}})
    ids = tokenizer.encode(answer, add_special_tokens=False)
    cases = {"json_object": StructuredOutput("json_object"),
             "json_schema": StructuredOutput("json", json.dumps({
                 "type": "object", "properties": {
                     "name": {"type": "string"}, "born": {"type": "integer"},
                     "languages": {"type": "array", "items": {"type": "string"}},
                     "notes": {"type": "object"}}})),
             "regex": StructuredOutput("regex", "[A-Z][a-z]+( [a-z]+){0,40}\\.")}
    logits = torch.randn(args.batch, vocab)
    bitmask = TokenBitmask(vocab)
    print(f"batch {args.batch}, vocab {vocab}: bitmask fill + apply per step (median of "
          f"{args.repeats})")
    for name, spec in cases.items():
        matchers, compiled = [], grammars.compile_spec(spec)
        for row in range(args.batch):
            matcher = grammars.matcher(compiled)
            if spec.kind != "regex":
                for token in ids[:row * len(ids) // args.batch]:
                    matcher.accept_token(token)
            matchers.append(matcher)
        times = []
        for _ in range(args.repeats):
            x = logits.clone()
            start = time.perf_counter()
            bitmask.apply(x, bitmask.fill(matchers))
            times.append((time.perf_counter() - start) * 1e3)
        print(f"  {name:<12} {statistics.median(times):7.2f} ms")
    return 0
