"""tritonserve bench lora [--model PATH] [--rank 16] [--adapters 4] [--dtype auto]: what LoRA
adapters cost.

Makes --adapters random PEFT adapters of --rank on the model's HF folder (peft, a test extra;
B drawn non-zero), then runs the engine offline on the same prompts: 1 stream and 16 streams,
an engine without adapters beside one serving them (its base requests, and every request
under an adapter: 16 streams spread over all adapters), runs alternating, greedy and with the
default sampling (temperature 1.0). Prints output tok/s and the ratios: adapters over no adapters (the target's)
and over the same engine's base requests. The targets (issue "LoRA adapters"): 16 streams over 4 adapters of rank 16 >= 0.7x
the base; 1 stream with an adapter >= 0.85x without.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def make_adapters(folder: str, count: int, rank: int, out: Path) -> list[str]:
    import peft
    import torch
    import transformers
    paths = []
    for i in range(count):
        torch.manual_seed(i)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        tuned = peft.get_peft_model(model, peft.LoraConfig(
            r=rank, lora_alpha=2 * rank, init_lora_weights=False, target_modules=[
                "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
        tuned.save_pretrained(out / f"a{i}")
        paths.append(f"a{i}={out / f'a{i}'}")
    return paths


def _rate(llm, prompts, params, loras) -> float:
    started = time.perf_counter()
    outs = llm.generate(prompts, params, lora=loras)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - started)


def run(model: str | None, rank: int, adapters: int, output_len: int,
        dtype: str = "auto", repeat: int = 3) -> dict:
    """Two engines side by side: one without adapters (what a user runs without LoRA: bf16
    dense gate/up keeps silu in its matmul) and one serving them. Each figure's runs alternate
    (no adapters, that engine's base requests, its adapter requests) `repeat` times and keep
    the medians: back-to-back blocks of one kind moved ~15 % against each other here."""
    from tritonserve.engine import LLM, SamplingParams
    from tritonserve.engine.default_model import default_model_path
    folder = model or str(default_model_path())
    plain = LLM(model, dtype=dtype)
    with tempfile.TemporaryDirectory() as tmp:
        modules = make_adapters(folder, adapters, rank, Path(tmp))
        llm = LLM(model, lora_modules=tuple(modules), dtype=dtype)
    names = [m.split("=", 1)[0] for m in modules]
    rows = []
    for streams in (1, 16):
        prompts = [llm.tokenizer.encode(f"Story {i}: once upon a time in town {i},")
                   for i in range(streams)]
        loras = [names[i % len(names)] for i in range(streams)]
        runs = [(plain, None), (llm, None), (llm, loras)]
        for sampling, options in (("greedy", {"temperature": 0.0}), ("default", {})):
            params = SamplingParams(max_tokens=output_len, ignore_eos=True, **options)
            for engine, which in runs:  # warm-up: each kind of step once
                _rate(engine, prompts[:1], SamplingParams(max_tokens=4),
                      which and which[:1])
            rates = [[_rate(engine, prompts, params, which) for engine, which in runs]
                     for _ in range(repeat)]
            plain_s, base_s, lora_s = (statistics.median(r[i] for r in rates)
                                       for i in range(3))
            rows.append({"streams": streams, "sampling": sampling, "plain_tok_s": plain_s,
                         "base_tok_s": base_s, "lora_tok_s": lora_s,
                         "ratio": lora_s / plain_s, "ratio_same_engine": lora_s / base_s})
    return {"model": folder, "rank": rank, "adapters": adapters,
            "dtype": llm.engine.config.dtype, "repeat": repeat, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tritonserve bench lora")
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2 (GGUF blocks)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3, help="runs a figure, the median kept")
    p.add_argument("--dtype", default="auto", help="the engine's dtype (auto: bf16 where the "
                   "CPU has native bf16, else fp32)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    out = run(args.model, args.rank, args.adapters, args.output_len, args.dtype, args.repeat)
    print(f"dtype {out['dtype']}")
    for row in out["rows"]:
        print(f"{row['streams']:>2} streams, {row['sampling']:<7}: no adapters "
              f"{row['plain_tok_s']:.1f} tok/s; an engine serving adapters: base "
              f"{row['base_tok_s']:.1f}, adapters {row['lora_tok_s']:.1f} tok/s "
              f"({row['ratio']:.2f}x of no adapters, {row['ratio_same_engine']:.2f}x of its "
              f"base)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0
