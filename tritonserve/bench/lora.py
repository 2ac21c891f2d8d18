"""tritonserve bench lora [--model PATH] [--rank 16] [--adapters 4] [--dtype auto]: what LoRA
adapters cost.

Makes --adapters random PEFT adapters of --rank on the model's HF folder (peft, a test extra;
B drawn non-zero), then runs the engine offline on the same prompts: 1 stream and 16 streams,
an engine without adapters, then one serving them (its base requests, then every request
under an adapter: 16 streams spread over all adapters), greedy and with the default sampling
(temperature 1.0). Prints output tok/s and the ratios: adapters over no adapters (the target's)
and over the same engine's base requests. The targets (issue "LoRA adapters"): 16 streams over 4 adapters of rank 16 >= 0.7x
the base; 1 stream with an adapter >= 0.85x without.
"""
from __future__ import annotations

import argparse
import json
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


def _rates(llm, streams_list, output_len, names) -> list[dict]:
    """Output tok/s per (streams, sampling): the base alone, then (names given) every request
    under an adapter, spread over them."""
    from tritonserve.engine import SamplingParams
    rows = []
    for streams in streams_list:
        prompts = [llm.tokenizer.encode(f"Story {i}: once upon a time in town {i},")
                   for i in range(streams)]
        for sampling, options in (("greedy", {"temperature": 0.0}), ("default", {})):
            params = SamplingParams(max_tokens=output_len, ignore_eos=True, **options)
            _rate(llm, prompts[:1], SamplingParams(max_tokens=4), None)  # warm-up
            row = {"streams": streams, "sampling": sampling,
                   "base_tok_s": _rate(llm, prompts, params, None)}
            if names:
                loras = [names[i % len(names)] for i in range(streams)]
                row["lora_tok_s"] = _rate(llm, prompts, params, loras)
            rows.append(row)
    return rows


def run(model: str | None, rank: int, adapters: int, output_len: int,
        dtype: str = "auto") -> dict:
    """An engine without adapters (the base a user runs without LoRA: bf16 dense gate/up
    keeps silu in its matmul), then one serving the adapters (base requests, then adapter
    requests)."""
    import gc

    from tritonserve.engine import LLM
    from tritonserve.engine.default_model import default_model_path
    folder = model or str(default_model_path())
    streams = (1, 16)
    plain = LLM(model, dtype=dtype)
    resolved = plain.engine.config.dtype
    alone = _rates(plain, streams, output_len, None)
    del plain
    gc.collect()
    with tempfile.TemporaryDirectory() as tmp:
        modules = make_adapters(folder, adapters, rank, Path(tmp))
        llm = LLM(model, lora_modules=tuple(modules), dtype=dtype)
        names = [m.split("=", 1)[0] for m in modules]
        rows = _rates(llm, streams, output_len, names)
    for row, base in zip(rows, alone):
        row["plain_tok_s"] = base["base_tok_s"]
        row["ratio"] = row["lora_tok_s"] / row["plain_tok_s"]
        row["ratio_same_engine"] = row["lora_tok_s"] / row["base_tok_s"]
    return {"model": folder, "rank": rank, "adapters": adapters, "dtype": resolved,
            "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tritonserve bench lora")
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2 (GGUF blocks)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dtype", default="auto", help="the engine's dtype (auto: bf16 where the "
                   "CPU has native bf16, else fp32)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    out = run(args.model, args.rank, args.adapters, args.output_len, args.dtype)
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
