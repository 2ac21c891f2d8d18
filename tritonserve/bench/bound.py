"""Is a batch-1 decode step bound by the machine's read rate? Rounds that alternate the read
rate (bench/cpu_decode.py's read_gbps, best of five sums of 256 MB) with a block of decode
steps of one sequence, so each step figure has the read rate of its own minute beside it.

tritonserve bench bound [--model PATH] [--quantization auto] [--rounds 6] [--steps 200]
    [--input-len 64] [--greedy]

Per round: the read rate, the core-to-core latency (a VM's two placements: docs/benchmarks.md,
"Two machines in one VM"), the step's median, the floor (the bytes a step streams -- packed
projections and the lm_head -- over that read rate), the step's share of it, and
decode_layers' matmul phases as GB/s of their own weights (thread 0's busy time). A step
that tracks the read rate is memory-bound; one that keeps its time while the read rate moves
is bound by its own work (on a 2-core Zen 4 the Q4_1 tiles stream ~25-39 GB/s of blocks
while the machine reads up to 64 on two CCDs: docs/perf-log/2026-12-04-quantized-weights.md,
"The tiles, not DRAM" and "Two machines in one VM").
"""
from __future__ import annotations

import argparse
import statistics
import time

from tritonserve.engine.config import QUANTIZATIONS, EngineConfig

MATMULS = ("qkv", "o", "gate/up", "down")  # decode_layers' matmul phases, in layer order


def streamed_bytes(model) -> tuple[int, list[int]]:
    """The bytes a decode step streams (every packed or quantized projection, the packed
    lm_head) and the per-layer bytes of qkv, o, gate/up, down summed over the layers."""
    per = [0, 0, 0, 0]
    for layer in model.layers:
        for i, lin in enumerate((layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                 layer.mlp.gate_up_proj, layer.mlp.down_proj)):
            per[i] += lin.weight.numel() * lin.weight.element_size()
    head = model.packed_tied_lm_head
    if head is None and not model.arch.tie_word_embeddings:
        head = model.lm_head.weight
    if head is None:
        head = model.embed_tokens.weight
    return sum(per) + head.numel() * head.element_size(), per


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tritonserve bench bound")
    parser.add_argument("--model", default=None, help="HF folder or .gguf (default: embedded)")
    parser.add_argument("--quantization", default=EngineConfig.quantization,
                        choices=QUANTIZATIONS)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--greedy", action="store_true", help="temperature 0")
    args = parser.parse_args(argv)
    for name in ("rounds", "steps", "input_len"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")

    from tritonserve.engine import LLM, SamplingParams
    from tritonserve.kernels import cpu

    from .cpu_decode import core_to_core_ns, read_gbps
    llm = LLM(args.model, max_num_seqs=1, quantization=args.quantization)
    engine = llm.engine
    streamed, per = streamed_bytes(engine.runner.model)
    print(f"a step streams {streamed / 1e6:.1f} MB ({engine.runner.kernels_in_use()})")
    params = SamplingParams(temperature=0.0 if args.greedy else 1.0,
                            max_tokens=args.steps + 3, ignore_eos=True)
    timed = cpu.decode_layers_timing(False)
    for r in range(args.rounds):
        read, ns = read_gbps(), core_to_core_ns()
        engine.add_request(list(range(10, 10 + args.input_len)), params)
        for _ in range(3):  # the prefill and two steps, untimed
            engine.step()
        if timed:
            cpu.decode_layers_timing(True)
        steps = []
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - start)
        step = statistics.median(steps)
        floor = streamed / (read * 1e9)
        line = (f"round {r + 1}: read {read:.1f} GB/s"
                + ("" if ns is None else f", core to core {ns:.0f} ns")
                + f", step {step * 1e3:.3f} ms, floor {floor * 1e3:.3f} ms "
                f"({100 * floor / step:.0f} %)")
        if timed:
            totals, calls = cpu.decode_layers_phases()
            cpu.decode_layers_timing(False)
            if calls:
                busy = (totals[0, :, 0] / calls).tolist()  # thread 0, s a call
                rates = [per[i] / 1e9 / busy[cpu.DECODE_PHASES.index(n)]
                         for i, n in enumerate(MATMULS)]
                line += "; matmuls " + ", ".join(f"{n} {g:.0f}" for n, g in zip(MATMULS, rates))
                line += " GB/s"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
