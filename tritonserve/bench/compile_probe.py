"""What torch.compile would buy the CPU decode step: the model's own forward for a decode-only
batch, eager (the engine today: oneDNN-prepacked weights) against compiled (Inductor, one
graph, `freezing` so Inductor prepacks the weights itself), at fixed batch sizes.

tritonserve bench compile-probe [--batches 1,16,64] [--context 300] [--steps 10]

The model alone, every sequence at `--context` tokens (no padding rows, so no null block
needed). Prints ms a step for both, the compile time per batch size, and the largest logit
difference. The engine's own compiled path is `tritonserve bench profile --decode-mode compile`.
"""
from __future__ import annotations

import argparse
import time

import torch

from tritonserve.engine.attention import AttentionMetadata, CpuAttention
from tritonserve.engine.default_model import default_model_path
from tritonserve.engine.models import ForwardContext, ModelArch
from tritonserve.engine.models.loader import build_model


def decode_batch(batch: int, context: int, block_size: int, vocab: int):
    """input_ids, positions [B] and metadata: sequence b owns blocks b*W .. b*W+W-1."""
    width = -(-context // block_size)
    tables = torch.arange(batch * width, dtype=torch.int32).view(batch, width)
    lens = torch.full((batch,), context, dtype=torch.int32)
    last = context - 1
    slots = tables[:, last // block_size].long() * block_size + last % block_size
    empty = torch.zeros(0, dtype=torch.int32)
    meta = AttentionMetadata(slots, batch, tables, lens, context, empty.view(0, 0), empty,
                             torch.zeros(1, dtype=torch.int32), 0)
    ids = torch.randint(0, vocab, (batch,), generator=torch.Generator().manual_seed(batch))
    return ids, torch.full((batch,), last, dtype=torch.int64), meta


def time_steps(fn, steps: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) / steps * 1000


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tritonserve bench compile-probe")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--block-size", type=int, default=16)
    args = p.parse_args(argv)
    import torch._inductor.config as inductor
    inductor.freezing = True  # weights are constants: Inductor prepacks them for oneDNN

    path = default_model_path()
    arch = ModelArch.from_folder(path)
    batches = [int(b) for b in args.batches.split(",")]
    eager = build_model(arch, path, torch.float32, torch.device("cpu"), args.context + 1)
    eager.prepack_weights("panels", batch_hint=max(batches))
    plain = build_model(arch, path, torch.float32, torch.device("cpu"), args.context + 1)
    blocks = max(batches) * -(-args.context // args.block_size)
    shape = (blocks, args.block_size, arch.num_kv_heads, arch.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(arch.num_layers)]
    backend = CpuAttention()
    print(f"SmolLM2 fp32, decode-only batches, context {args.context}, "
          f"{torch.get_num_threads()} threads")
    print("| batch | eager ms/step | compiled ms/step | speed-up | compile s | max logit diff |")
    print("|---|---|---|---|---|---|")
    for batch in batches:
        ids, positions, meta = decode_batch(batch, args.context, args.block_size,
                                            arch.vocab_size)
        ctx = ForwardContext(meta, caches, backend)

        def run_eager():
            with torch.inference_mode():
                return eager.compute_logits(eager(ids, positions, ctx))

        def step(ids, positions):
            return plain.compute_logits(plain(ids, positions, ctx))

        compiled = torch.compile(step, fullgraph=True, dynamic=False)
        start = time.perf_counter()
        with torch.no_grad():
            got = compiled(ids, positions)
        compile_s = time.perf_counter() - start
        diff = (got - run_eager()).abs().max().item()
        eager_ms = time_steps(run_eager, args.steps)
        with torch.no_grad():
            compiled_ms = time_steps(lambda: compiled(ids, positions), args.steps)
        print(f"| {batch} | {eager_ms:.1f} | {compiled_ms:.1f} | {eager_ms / compiled_ms:.2f}x "
              f"| {compile_s:.0f} | {diff:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
