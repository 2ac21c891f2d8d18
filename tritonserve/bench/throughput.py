"""Offline throughput: this engine vs transformers `generate` on the same prompts.

tritonserve bench throughput [--model PATH] [--num-prompts 64] [--output-len 128]
    [--input-len 100 | --input-range 50:400] [--hf-batch-size 64] [--skip-hf]
    [--temperature 1.0] [--top-p 1.0]

The engine runs twice: greedy, then with the sampling options (by default the server's
default sampling, temperature 1.0), each on prompts of its own (same lengths, other random
tokens), so that neither run finds the other's prompts in the prefix cache (the sampled run
used to, and read 1.21x greedy for it); the result records the prefix-cache hits of each
run. transformers runs greedy on the greedy run's prompts, same dtype, batched with left
padding. EOS is ignored so every request produces --output-len tokens. The compute ceiling is
measured here with a large matmul in the engine's dtype (the faster of torch's BLAS and the
engine's oneDNN linear); the engine's fraction of it is model FLOPs per token x tokens/s over
it.
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch


def _gflops(matmul, a: torch.Tensor, b: torch.Tensor, repeats: int) -> float:
    matmul(a, b)
    start = time.perf_counter()
    for _ in range(repeats):
        matmul(a, b)
    seconds = (time.perf_counter() - start) / repeats
    return 2 * a.shape[0] * a.shape[1] * b.shape[0] / seconds / 1e9


def measure_matmul_gflops(size: int = 2048, repeats: int = 5,
                          dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """The rate of a size^3 matmul in `dtype` (fp32, or bf16 for a bf16 run's ceiling) through
    torch's default BLAS (`a @ b^T`) and through the engine's own `linear` on a plain weight
    (oneDNN on the CPU). The ceiling is the faster of the two, so the engine's fraction of it
    is never flattered by a slow library."""
    from tritonserve.engine.models.linear import linear
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    with torch.inference_mode():  # as in the engine: linear takes oneDNN only without autograd
        return {"torch_mm": _gflops(lambda x, w: x @ w.t(), a, b, repeats),
                "engine_linear": _gflops(linear, a, b, repeats)}


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The model and prompt options `throughput` and `profile` share."""
    parser.add_argument("--model", default=None, help="HF folder (default: embedded SmolLM2)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=100)
    parser.add_argument("--input-range", default=None, help="MIN:MAX uniform prompt lengths")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="sampled run (default: the server's default sampling)")
    parser.add_argument("--top-p", type=float, default=1.0)


def sampling(args: argparse.Namespace, max_tokens: int, greedy: bool = False):
    from tritonserve.engine import SamplingParams
    if greedy:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return SamplingParams(temperature=args.temperature, top_p=args.top_p,
                          max_tokens=max_tokens, ignore_eos=True)


def prompt_lengths(num: int, input_len: int, input_range: str | None, seed: int) -> list[int]:
    """`num` x input_len, or lengths drawn uniformly from input_range "MIN:MAX"."""
    if not input_range:
        return [input_len] * num
    low, high = map(int, input_range.split(":"))
    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(num)]


def make_prompts(tokenizer, num: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = [i for i in range(tokenizer.vocab_size) if i not in tokenizer.all_special_ids]
    return [[rng.choice(vocab[100:]) for _ in range(n)] for n in lengths[:num]]


def run_engine(llm, prompts: list[list[int]], params) -> tuple[float, int]:
    """(output tok/s, prompt tokens the prefix cache served) of one generate call."""
    output_len = params.max_tokens
    stats = llm.engine.kv_cache.stats
    hits_before = stats.hit_tokens
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(o.token_ids) == output_len for o in outs)
    return len(prompts) * output_len / elapsed, stats.hit_tokens - hits_before


def run_transformers(model_path: str, prompts: list[list[int]], output_len: int,
                     batch_size: int, dtype: torch.dtype) -> float:
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    total = 0
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i:i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
                                 min_new_tokens=output_len, do_sample=False, pad_token_id=0)
        total += (out.shape[1] - width) * len(batch)
    return total / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tritonserve bench throughput")
    add_workload_args(parser)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--result-json", default=None)
    args = parser.parse_args(argv)

    from tritonserve.engine import LLM
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              cache_bytes=1 << 30)
    model_path = str(llm.engine.model_path)
    lengths = prompt_lengths(args.num_prompts, args.input_len, args.input_range, args.seed)
    warm, prompts, sampled_prompts = (
        make_prompts(llm.tokenizer, args.num_prompts, lengths, args.seed + k) for k in (2, 0, 1))
    run_engine(llm, warm[:2], sampling(args, 4))  # warm-up
    engine_tps, greedy_hits = run_engine(llm, prompts, sampling(args, args.output_len,
                                                                greedy=True))
    sampled_tps, sampled_hits = run_engine(llm, sampled_prompts, sampling(args, args.output_len))
    dtype = llm.engine.config.torch_dtype
    rates = measure_matmul_gflops(dtype=dtype)
    gflops = max(rates.values())
    flops_per_token = llm.engine.arch.flops_per_token()
    result = {
        "model": llm.engine.model_name, "num_prompts": args.num_prompts,
        "input_lens": f"{min(lengths)}-{max(lengths)}", "output_len": args.output_len,
        "dtype": args.dtype, "engine_tok_s": round(engine_tps, 1),
        "prefix_hit_tokens": {"greedy": greedy_hits, "sampled": sampled_hits},
        "sampled": {"temperature": args.temperature, "top_p": args.top_p,
                    "engine_tok_s": round(sampled_tps, 1),
                    "vs_greedy": round(sampled_tps / engine_tps, 3)},
        "ceiling_dtype": str(dtype).removeprefix("torch."),
        "matmul_gflops": {name: round(rate, 1) for name, rate in rates.items()},
        "engine_fraction_of_ceiling": round(engine_tps * flops_per_token / (gflops * 1e9), 3),
    }
    print(f"engine:        {engine_tps:8.1f} output tok/s (greedy)")
    print(f"engine:        {sampled_tps:8.1f} output tok/s (temperature {args.temperature:g}, "
          f"top_p {args.top_p:g}: {sampled_tps / engine_tps:.2f}x greedy)")
    if not args.skip_hf:
        hf_tps = run_transformers(model_path, prompts, args.output_len, args.hf_batch_size,
                                  llm.engine.config.torch_dtype)
        result["transformers_tok_s"] = round(hf_tps, 1)
        result["ratio"] = round(engine_tps / hf_tps, 2)
        print(f"transformers:  {hf_tps:8.1f} output tok/s (batch {args.hf_batch_size})")
        print(f"ratio:         {engine_tps / hf_tps:8.2f}x")
    print(f"ceiling:       {gflops:8.1f} GFLOP/s {result['ceiling_dtype']} 2048^3 matmul (torch mm "
          f"{rates['torch_mm']:.0f}, engine linear {rates['engine_linear']:.0f}); "
          f"{flops_per_token / 1e6:.0f} MFLOP per token -> engine at "
          f"{result['engine_fraction_of_ceiling']:.1%} of it")
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
