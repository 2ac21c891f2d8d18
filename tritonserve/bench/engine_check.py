"""The engine end to end on a dummy model, for tritonserve/bench/gpu_check.sh: Triton vs torch
attention agreement (greedy), decode tok/s at several batch sizes, and transformers `generate_batch`
(continuous batching) on the same shapes.

tritonserve bench engine-check [--shape llama3-8b | tiny] [--dtype bfloat16] [--batches 1,64,256]
    [--input-len 128] [--output-len 64] [--json PATH]

--shape llama3-8b: 32 layers, hidden 4096, 32 query / 8 KV heads of 128, MLP 14336, vocab
128256 (Llama-3-8B), random weights (load_format dummy). --shape tiny is the CPU rehearsal
(`gpu_check.sh --dry-run`): same sections, a 2-layer model, the Triton path interpreted.
Decode tok/s counts the tokens of the steps after every prompt is prefilled, over their time;
end-to-end tok/s (prefill included) is what compares with transformers. The decode section
runs twice: `--enforce-eager` and with CUDA graphs (every decode bucket captured at start-up;
on the CPU rehearsal the same static-buffer path without the capture, decode_mode static).
"""
from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      max_position_embeddings=8192, rope_theta=500000.0),
    # issue 68's first-burst shape (Llama-3.2-1B's layers, heads and vocabulary)
    "llama3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                        max_position_embeddings=8192, rope_theta=500000.0),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512),
}


def write_dummy_model(folder: Path, shape: str, dtype: str) -> Path:
    """config.json and a word-level tokenizer with one token per id ("t0" .. "tN"), so any
    sampled id decodes; no weights (the engine fills them at random: load_format dummy)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    fields = SHAPES[shape]
    config = transformers.LlamaConfig(**fields, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                      bos_token_id=1, eos_token_id=2, dtype=dtype)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(fields["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0",
                                                bos_token="t1", eos_token="t2", pad_token="t0")
    fast.save_pretrained(folder)
    return folder


def prompts(num: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (num, length), generator=gen).tolist()


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def agreement(folder: Path, args, device: str) -> dict:
    """Greedy tokens from the Triton and torch attention backends on the same weights."""
    from tritonserve.engine import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.agree_tokens, ignore_eos=True)
    batch = prompts(args.agree_prompts, args.input_len, SHAPES[args.shape]["vocab_size"], 1)
    outputs = {}
    for backend in ("triton", "torch"):
        llm = LLM(str(folder), device=device, dtype=args.dtype, load_format="dummy",
                  attention_backend=backend, max_num_seqs=len(batch),
                  cache_bytes=args.cache_gib << 30 if args.cache_gib else None)
        outputs[backend] = [o.token_ids for o in llm.generate(batch, params)]
        del llm
        free_device_memory()
    same = sum(a == b for a, b in zip(outputs["triton"], outputs["torch"]))
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
              for a, b in zip(outputs["triton"], outputs["torch"])]
    return {"sequences": len(batch), "identical": same, "tokens": args.agree_tokens,
            "mean_common_prefix": sum(prefix) / len(prefix)}


def engine_decode(folder: Path, args, device: str, mode: str) -> list[dict]:
    """Decode tok/s of this engine (default backends, cache sized by the engine) per batch,
    in one decode mode (eager, static, cudagraph)."""
    from tritonserve.engine import LLM, SamplingParams

    rows = []
    largest = max(args.batches)
    start = time.perf_counter()
    llm = LLM(str(folder), device=device, dtype=args.dtype, load_format="dummy",
              max_num_seqs=largest, decode_mode=mode,
              cache_bytes=args.cache_gib << 30 if args.cache_gib else None)
    start_s = time.perf_counter() - start
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    vocab = SHAPES[args.shape]["vocab_size"]
    llm.generate(prompts(2, args.input_len, vocab, 9), params)  # warm-up: compile, autotune
    for batch in args.batches:
        _sync(device)
        begin = time.perf_counter()
        for prompt in prompts(batch, args.input_len, vocab, batch):
            engine.add_request(prompt, params)
        while engine.num_waiting or any(r.num_computed_tokens < len(r.prompt_token_ids)
                                        for r in engine.scheduler.running):
            engine.step()
        produced = sum(len(r.output_token_ids) for r in engine.scheduler.running)
        _sync(device)
        start = time.perf_counter()
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        _sync(device)
        end = time.perf_counter()
        rows.append({"batch": batch, "mode": mode, "start_s": start_s,
                     "decode_tok_s": (batch * args.output_len - produced) / (end - start),
                     "ms_per_step": 1000 * (end - start) / max(1, steps),
                     "end_to_end_tok_s": batch * args.output_len / (end - begin),
                     "kv_cache_blocks": engine.kv_cache.num_blocks})
    del llm, engine
    free_device_memory()
    return rows


def transformers_batch(folder: Path, args, device: str, batch: int) -> dict:
    """transformers' continuous batching (`generate_batch`) on a random model of this shape."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(getattr(torch, args.dtype)).eval()
    generation = transformers.GenerationConfig(max_new_tokens=args.output_len, do_sample=False,
                                               eos_token_id=-1, pad_token_id=0)
    batch_prompts = prompts(batch, args.input_len, SHAPES[args.shape]["vocab_size"], batch)
    model.generate_batch(batch_prompts[:2], generation_config=generation,
                         warmup=device == "cuda")  # warm-up
    _sync(device)
    start = time.perf_counter()
    out = model.generate_batch(batch_prompts, generation_config=generation,
                               warmup=device == "cuda")
    _sync(device)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.generated_tokens) for o in out.values())
    del model
    free_device_memory()
    return {"batch": batch, "tok_s": tokens / seconds, "tokens": tokens}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def report(result: dict) -> str:
    lines = [f"engine check: {result['shape']} {result['dtype']} on {result['device']}, "
             f"prompts of {result['input_len']}, {result['output_len']} output tokens"]
    a = result["agreement"]
    lines.append(f"triton vs torch greedy: {a['identical']}/{a['sequences']} sequences identical "
                 f"over {a['tokens']} tokens, mean common prefix {a['mean_common_prefix']:.1f}")
    eager, graphs = result["engine"]["eager"], result["engine"]["graphs"]
    lines.append(f"engine start-up: eager {eager[0]['start_s']:.1f} s, "
                 f"{graphs[0]['mode']} {graphs[0]['start_s']:.1f} s (buckets built at start)")
    lines.append(f"| batch | decode tok/s eager | ms/step eager | decode tok/s {graphs[0]['mode']} "
                 f"| ms/step | best end to end tok/s | transformers generate_batch tok/s "
                 f"(end to end) | ratio |")
    lines.append("|---|---|---|---|---|---|---|---|")
    hf = {r["batch"]: r for r in result["transformers"]}
    for row, fast in zip(eager, graphs):
        other = hf.get(row["batch"])
        theirs = f"{other['tok_s']:.1f}" if other else "-"
        best = max(row["end_to_end_tok_s"], fast["end_to_end_tok_s"])
        ratio = f"{best / other['tok_s']:.2f}x" if other else "-"
        lines.append(f"| {row['batch']} | {row['decode_tok_s']:.1f} | {row['ms_per_step']:.1f} "
                     f"| {fast['decode_tok_s']:.1f} | {fast['ms_per_step']:.1f} "
                     f"| {best:.1f} | {theirs} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tritonserve bench engine-check")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", default="1,64,256")
    p.add_argument("--hf-batches", default="64", help="transformers generate_batch sizes")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--agree-prompts", type=int, default=8)
    p.add_argument("--agree-tokens", type=int, default=32)
    p.add_argument("--cache-gib", type=int, default=0,
                   help="KV cache size; 0 sizes it from memory (the engine's default)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    hf_batches = [int(b) for b in args.hf_batches.split(",") if b]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    graph_mode = "cudagraph" if device == "cuda" else "static"
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_dummy_model(Path(tmp), args.shape, args.dtype)
        result = {"shape": args.shape, "dtype": args.dtype, "device": device,
                  "input_len": args.input_len, "output_len": args.output_len,
                  "agreement": agreement(folder, args, device),
                  "engine": {"eager": engine_decode(folder, args, device, "eager"),
                             "graphs": engine_decode(folder, args, device, graph_mode)},
                  "transformers": [transformers_batch(folder, args, device, b)
                                   for b in hf_batches]}
    text = report(result)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
