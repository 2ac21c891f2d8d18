"""Decode steps of this tree against another checkout of the project, alternated in one run.

tritonserve bench ab-trees --other DIR [--batches 1,16,64] [--rounds 4] [--blocks 8]
    [--block-steps 10] [--input-len 100] [--dtype auto] [--greedy]

"No step slower" for a change: check out the commit before it (`git worktree add DIR REV`)
and run this from the tree after it. Each round runs every batch size on both trees, the order
turning from round to round, each side in its own process from its own folder (its own
package and C++ library). A side builds the embedded model's engine, fills the batch, and
times --blocks blocks of --block-steps decode steps. A VM's steal time lands in whole
blocks, so each side's figure is its best block and its median block; the table gives both
sides' medians over the rounds and the after / before ratio of each.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

SIDE = r"""
import json, sys, time
from tritonserve.engine import LLM, SamplingParams
batch, blocks, steps, input_len, dtype, greedy = json.loads(sys.argv[1])
llm = LLM(None, dtype=dtype, max_num_seqs=batch)
engine = llm.engine
params = SamplingParams(temperature=0.0 if greedy else 1.0, max_tokens=blocks * steps + 16,
                        ignore_eos=True)
for i in range(batch):
    engine.add_request([(7 * i + j) % 1000 + 10 for j in range(input_len)], params)
while engine.num_waiting or any(r.num_computed_tokens < len(r.prompt_token_ids)
                                for r in engine.scheduler.running):
    engine.step()
for _ in range(3):
    engine.step()
times = []
for _ in range(blocks):
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    times.append((time.perf_counter() - start) / steps * 1e3)
print("AB " + json.dumps(times))
"""


def run_side(folder: Path, batch: int, args) -> list[float]:
    python = folder / ".venv" / "bin" / "python"
    config = json.dumps([batch, args.blocks, args.block_steps, args.input_len, args.dtype,
                         args.greedy])
    proc = subprocess.run([str(python if python.exists() else sys.executable), "-c", SIDE,
                           config], cwd=folder, capture_output=True, text=True, check=True)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("AB "))
    return json.loads(line[3:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tritonserve bench ab-trees")
    parser.add_argument("--other", required=True, help="the checkout to compare against")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--block-steps", type=int, default=10)
    parser.add_argument("--input-len", type=int, default=100)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--greedy", action="store_true", help="temperature 0")
    args = parser.parse_args(argv)
    sides = {"before": Path(args.other).resolve(), "after": Path.cwd().resolve()}
    batches = [int(b) for b in args.batches.split(",")]
    best: dict[tuple[str, int], list[float]] = {}
    median: dict[tuple[str, int], list[float]] = {}
    for round_ in range(args.rounds):
        for batch in batches:
            order = ("before", "after") if round_ % 2 == 0 else ("after", "before")
            for side in order:
                times = run_side(sides[side], batch, args)
                best.setdefault((side, batch), []).append(min(times))
                median.setdefault((side, batch), []).append(statistics.median(times))
                print(f"round {round_ + 1} batch {batch} {side}: best block "
                      f"{min(times):.2f} ms, median block {statistics.median(times):.2f} ms",
                      flush=True)
    print("\n| batch | before: best / median block, ms a step | after | after / before |")
    print("|---|---|---|---|")
    for batch in batches:
        b = [statistics.median(best[("before", batch)]),
             statistics.median(median[("before", batch)])]
        a = [statistics.median(best[("after", batch)]),
             statistics.median(median[("after", batch)])]
        print(f"| {batch} | {b[0]:.2f} / {b[1]:.2f} | {a[0]:.2f} / {a[1]:.2f} | "
              f"{a[0] / b[0]:.3f} / {a[1] / b[1]:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
