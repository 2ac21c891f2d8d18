"""What tensor parallelism costs a decode step on this machine: one engine at
tensor_parallel_size 1 and one at 2 (gloo, each rank its share of the cores), the same
SmolLM2-shaped model with 8 query / 4 KV heads (SmolLM2's 9 / 3 do not split in two) and
random weights, both eager (the path tp runs), and the time rank 0 spends in its all-reduces
(2 a layer: after o and after down, each waiting for the other rank too), over shared memory
(what tp uses on one machine's CPU) and over gloo.

tritonserve bench tp-cost [--batches 1,64] [--steps 30] [--dtype bfloat16] [--json PATH]

On a machine of few cores neither rank count is expected to be faster: the figure is the
overhead a larger machine pays for the split.
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from tritonserve.engine import LLMEngine, SamplingParams
from tritonserve.engine import parallel, tp_runner
from tritonserve.engine.default_model import default_model_path
from tritonserve.engine.llm import build_config

SHAPE = {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64}


def model_folder() -> Path:
    """The embedded model's config and tokenizer with SHAPE's heads (weights: dummy)."""
    source = default_model_path()
    folder = Path(tempfile.mkdtemp(prefix="tp-cost-"))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, folder / name)
    config = json.loads((source / "config.json").read_text())
    config.update(SHAPE)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def measure(folder: Path, tp: int, batch: int, steps: int, dtype: str, by: str) -> dict:
    spent = {"s": 0.0, "calls": 0}
    reduce = parallel.Shard.all_reduce

    def timed(self, t):
        start = time.perf_counter()
        reduce(self, t)
        spent["s"] += time.perf_counter() - start
        spent["calls"] += 1

    parallel.Shard.all_reduce = timed
    tp_runner.USE_SHM = by == "shm"
    engine = LLMEngine(build_config(str(folder), dtype=dtype, load_format="dummy",
                                    decode_mode="eager", tensor_parallel_size=tp,
                                    max_num_seqs=batch))
    try:
        params = SamplingParams(temperature=1.0, max_tokens=steps + 8, ignore_eos=True)
        for i in range(batch):
            engine.add_request([(7 * i + j) % 1000 + 10 for j in range(64)], params)
        while any(r.num_computed_tokens < len(r.prompt_token_ids)
                  for r in engine.scheduler.running) or engine.num_waiting:
            engine.step()
        for _ in range(3):
            engine.step()
        spent.update(s=0.0, calls=0)
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        step_ms = (time.perf_counter() - start) / steps * 1e3
        return {"tp": tp, "by": by if tp > 1 else "-", "batch": batch,
                "step_ms": round(step_ms, 2),
                "all_reduce_ms": round(spent["s"] / steps * 1e3, 3),
                "all_reduces_a_step": spent["calls"] // steps}
    finally:
        engine.close()
        parallel.Shard.all_reduce = reduce
        tp_runner.USE_SHM = True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tritonserve bench tp-cost")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    folder = model_folder()
    rows = []
    try:
        for batch in (int(b) for b in args.batches.split(",")):
            for tp, by in ((1, "-"), (2, "shm"), (2, "gloo")):
                rows.append(measure(folder, tp, batch, args.steps, args.dtype, by))
                r = rows[-1]
                print(f"tp {tp} ({by}) batch {batch}: {r['step_ms']} ms a step, all-reduce "
                      f"{r['all_reduce_ms']} ms ({r['all_reduces_a_step']} a step)",
                      flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0
