"""Where an engine step's time goes: prefill, then decode steps at full batch.

tritonserve bench profile [--model PATH] [--num-prompts 64] [--input-len 100 |
    --input-range 50:400] [--steps 30] [--profile-steps 5] [--rows 15]
    [--temperature 1.0] [--top-p 1.0] [--greedy] [--dtype auto] [--quantization auto]
    [--ab-direct 12]

Adds the prompts, steps until every one is decoding, times --steps decode steps, then runs
--profile-steps more under torch.profiler and prints the share of each phase of the step
(prepare, forward, logits, sampler) and the per-op table (self CPU time); with the CPU's
layers decode, --profile-steps more with decode_layers' own phases timed per thread. Every
decode-step figure in docs/perf-log/ was found this way. --ab-direct N (compiled decode)
then times blocks of N steps with the compiled graph called directly and through Dynamo, in
the order ABBA ABBA ... (the contexts grow during the run; this order cancels a linear trend),
and prints each side's median block.
"""
from __future__ import annotations

import argparse
import statistics
import time

from tritonserve.engine.config import (CLI_DECODE_MODES, DTYPE_CHOICES, QUANTIZATIONS,
                                       EngineConfig)

from .throughput import add_workload_args, make_prompts, prompt_lengths

PHASES = ("prepare", "forward", "logits", "sampler")  # record_function ranges, model_runner.py


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tritonserve bench profile")
    add_workload_args(parser)
    parser.add_argument("--dtype", default=EngineConfig.dtype, choices=DTYPE_CHOICES,
                        help="default: the server's (auto: bf16 where the CPU has it)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--rows", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--greedy", action="store_true", help="temperature 0")
    parser.add_argument("--decode-mode", default=EngineConfig.decode_mode,
                        choices=CLI_DECODE_MODES)
    parser.add_argument("--quantization", default=EngineConfig.quantization,
                        choices=QUANTIZATIONS, help="the weights' form (engine/plan.py)")
    parser.add_argument("--decode-buckets", default="",
                        help="comma-separated sizes (default: the batch size alone)")
    parser.add_argument("--ab-direct", type=int, default=0, metavar="N",
                        help="blocks of N steps: direct graph calls against Dynamo's path")
    args = parser.parse_args(argv)
    for name in ("steps", "profile_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")

    from torch.profiler import ProfilerActivity, profile

    from tritonserve.engine import LLM

    from .throughput import sampling
    buckets = tuple(int(b) for b in args.decode_buckets.split(",") if b) or (args.num_prompts,)
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.num_prompts,
              decode_mode=args.decode_mode, decode_buckets=buckets,
              quantization=args.quantization)
    engine = llm.engine
    lengths = prompt_lengths(args.num_prompts, args.input_len, args.input_range, args.seed)
    # enough output tokens that nobody finishes during the measured steps
    ab_steps = 4 * args.ab_direct * AB_ROUNDS
    params = sampling(args, args.steps + args.profile_steps + ab_steps + 8, greedy=args.greedy)
    for prompt in make_prompts(llm.tokenizer, args.num_prompts, lengths, args.seed):
        engine.add_request(prompt, params)

    start = time.perf_counter()
    prefill_steps = 0
    while engine.num_waiting or any(r.num_computed_tokens < len(r.prompt_token_ids)
                                    for r in engine.scheduler.running):
        engine.step()
        prefill_steps += 1
    prefill_s = time.perf_counter() - start
    engine.step()  # the first step in which every request decodes
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    step_ms = (time.perf_counter() - start) / args.steps * 1e3
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(args.profile_steps):
            engine.step()
        profiled_ms = (time.perf_counter() - start) / args.profile_steps * 1e3
    print(f"prefill: {sum(lengths)} prompt tokens in {prefill_steps} steps, {prefill_s:.2f} s")
    print(f"decode:  {step_ms:.1f} ms per step at batch {args.num_prompts} "
          f"(mean of {args.steps}; temperature {params.temperature:g}, top_p "
          f"{params.top_p:g}); per-op table over {args.profile_steps} steps:")
    averages = prof.key_averages()
    phases = {e.key: e.cpu_time_total / 1e3 / args.profile_steps for e in averages
              if e.key in PHASES}
    # every op the dispatcher ran (aten, the tritonserve ops, nested calls included); a
    # compiled region counts its generated kernels instead
    ops = sum(e.count for e in averages if "::" in e.key) / args.profile_steps
    print(f"dispatched ops per step: {ops:.0f} ({llm.engine.config.dtype}; "
          f"{llm.engine.runner.plan.describe()})")
    print(f"phases of a profiled step ({profiled_ms:.1f} ms, profiler on): " + ", ".join(
        f"{name} {phases.get(name, 0.0):.1f} ms ({phases.get(name, 0.0) / profiled_ms:.1%})"
        for name in PHASES))
    print(averages.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    if engine.runner.plan.mode == "layers":
        print_layer_phases(engine, args.profile_steps)
    if args.ab_direct:
        graphs = engine.runner.graphs
        if graphs is None or graphs.mode != "compile":
            print("--ab-direct: the decode is not compiled; nothing to compare")
            return 1
        blocks = ab_direct(engine, graphs, args.ab_direct)
        print(f"direct calls vs Dynamo, {AB_ROUNDS} x ABBA blocks of {args.ab_direct} steps: "
              + ", ".join(f"{name} {statistics.median(ms):.2f} ms" for name, ms in blocks.items())
              + " (median block)")
    return 0


AB_ROUNDS = 4


def print_layer_phases(engine, steps: int) -> None:
    """decode_layers' own phases over `steps` more steps (kernels/cpu/phase_clock.h): per
    thread, ms a step of work and of waiting at the phase's barrier."""
    from tritonserve.kernels import cpu
    if not cpu.decode_layers_timing(True):
        return
    try:
        for _ in range(steps):
            engine.step()
        totals, calls = cpu.decode_layers_phases()
    finally:
        cpu.decode_layers_timing(False)
    if calls == 0:
        return
    per_step = totals * 1e3 / calls  # [threads, phases, 2] ms
    print(f"decode_layers phases over {calls} calls, ms a step (busy / wait at its barrier):")
    for t, row in enumerate(per_step.tolist()):
        print(f"  thread {t}: " + ", ".join(
            f"{name} {busy:.2f} / {wait:.2f}"
            for name, (busy, wait) in zip(cpu.DECODE_PHASES, row))
            + f"; total {sum(b + w for b, w in row):.1f}")


def ab_direct(engine, graphs, steps: int) -> dict[str, list[float]]:
    """Median step of each block, direct calls on (A) and off (B), ABBA x AB_ROUNDS."""
    blocks: dict[str, list[float]] = {"direct": [], "dynamo": []}
    for on in [True, False, False, True] * AB_ROUNDS:
        graphs.direct_calls = on
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append((time.perf_counter() - start) * 1e3)
        blocks["direct" if on else "dynamo"].append(statistics.median(times))
    graphs.direct_calls = True
    return blocks
