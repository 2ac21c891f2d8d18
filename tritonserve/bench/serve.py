"""Serving benchmark that validates the protocol of every stream.

tritonserve bench serve --base-url URL --endpoint native|completions|chat --num-prompts N
    (--request-rate R | --max-concurrency C) --input-len L --output-len M
    [--dataset random|shared-prefix|PATH.jsonl] [--num-prefixes K --prefix-len P]
    [--tokenizer PATH] [--seed S] [--goodput ttft:MS tpot:MS]
    [--result-json PATH] [--plot PATH.png] [--model NAME] [--no-ignore-eos]

Output tokens are the server's count (done event or usage); the client's count is kept
beside it, and a disagreement is a protocol error, never silently averaged away.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import aiohttp

from .client import RequestRecord, send
from .workload import arrival_gaps, jsonl_requests, random_requests, shared_prefix_requests

PERCENTILES = (50, 90, 99)


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * p / 100
    low, high = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


def describe(values: list[float]) -> dict:
    ms = [v * 1000 for v in values]
    out = {"mean": statistics.fmean(ms) if ms else float("nan"),
           "median": percentile(ms, 50)}
    for p in PERCENTILES[1:]:
        out[f"p{p}"] = percentile(ms, p)
    return out


def summarize(records: list[RequestRecord], duration: float, slo: dict) -> dict:
    ok = [r for r in records if r.ok]
    output = sum(r.output_tokens or 0 for r in ok)
    good = [r for r in ok if (r.ttft_s or 0) * 1000 <= slo.get("ttft", float("inf"))
            and (r.tpot_s or 0) * 1000 <= slo.get("tpot", float("inf"))]
    return {
        "completed": len(ok),
        "failed": sum(1 for r in records if r.error is not None),
        "protocol_errors": sum(1 for r in records if r.protocol_error is not None),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": output / duration,
        "total_output_tokens": output,
        "ttft_ms": describe([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": describe([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_ms": describe([x for r in ok for x in r.itl_s]),
        "e2e_ms": describe([r.e2e_s for r in ok if r.e2e_s is not None]),
        "goodput": {"slo_ms": slo, "requests_per_s": len(good) / duration,
                    "fraction": len(good) / len(records) if records else 0.0} if slo else None,
    }


def print_table(summary: dict, args) -> None:
    line = "=" * 62
    print(line)
    print(f" Serving benchmark: {args.endpoint} at {args.base_url}")
    print(line)
    rows = [("Completed requests", summary["completed"]), ("Failed requests", summary["failed"]),
            ("Protocol errors", summary["protocol_errors"]),
            ("Duration (s)", f"{summary['duration_s']:.2f}"),
            ("Request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{summary['output_throughput']:.2f}"),
            ("Total output tokens", summary["total_output_tokens"])]
    for name, value in rows:
        print(f" {name:<40}{value:>20}")
    for key, title in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"),
                       ("e2e_ms", "E2E latency")):
        stats = summary[key]
        print(f" {title + ' (ms)':<16}" + "  ".join(f"{k} {v:8.1f}" for k, v in stats.items()))
    if summary["goodput"]:
        g = summary["goodput"]
        print(f" {'Goodput (req/s) under ' + str(g['slo_ms']):<40}{g['requests_per_s']:>20.2f}")
    print(line)


def plot(records: list[RequestRecord], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = [r for r in records if r.ok]
    series = [("TTFT (ms)", [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]),
              ("TPOT (ms)", [r.tpot_s * 1000 for r in ok if r.tpot_s is not None]),
              ("ITL (ms)", [x * 1000 for r in ok for x in r.itl_s]),
              ("E2E (ms)", [r.e2e_s * 1000 for r in ok if r.e2e_s is not None])]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.5))
    for ax, (title, values) in zip(axes, series):
        ax.hist(values or [0], bins=30, color="#3b6ea8")
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


class Progress:
    def __init__(self, total: int) -> None:
        self.total, self.done, self.bad = total, 0, 0

    def update(self, record: RequestRecord) -> None:
        self.done += 1
        self.bad += not record.ok
        width = 30
        filled = width * self.done // self.total
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total}"
                         f" ({self.bad} not ok)")
        if self.done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def sampling_fields(args) -> dict:
    """The sampling fields to send: only those given, so the rest are the server's defaults."""
    return {name: value for name, value in (("temperature", args.temperature),
                                            ("top_p", args.top_p)) if value is not None}


SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


async def spec_counters(session: aiohttp.ClientSession, base_url: str) -> dict | None:
    """The server's speculative-decoding counters (vLLM's spec_decode_*), or None when it
    has none (or no /metrics)."""
    try:
        async with session.get(base_url + "/metrics") as response:
            text = await response.text() if response.status == 200 else ""
    except aiohttp.ClientError:
        return None
    found = {}
    for line in text.splitlines():
        for name in SPEC_COUNTERS:
            for prefix in ("tritonserve:", "vllm:"):
                if line.startswith(f"{prefix}spec_decode_{name}_total"):
                    found[name] = found.get(name, 0.0) + float(line.split()[-1])
    return found if len(found) == len(SPEC_COUNTERS) else None


def speculation(before: dict | None, after: dict | None) -> dict | None:
    """Acceptance rate and mean accepted length over the run (between two readings)."""
    if before is None or after is None:
        return None
    d = {name: after[name] - before[name] for name in SPEC_COUNTERS}
    if not d["num_draft_tokens"]:
        return {"acceptance_rate": None, "mean_accepted_length": None, **d}
    return {"acceptance_rate": d["num_accepted_tokens"] / d["num_draft_tokens"],
            "mean_accepted_length": 1 + d["num_accepted_tokens"] / d["num_drafts"], **d}


async def run(args, requests) -> tuple[list[RequestRecord], float, dict | None]:
    gaps = arrival_gaps(len(requests), args.request_rate, args.seed)
    limit = asyncio.Semaphore(args.max_concurrency or len(requests))
    progress = Progress(len(requests))
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        models = args.model.split(",") if args.model else [None]

        async def one(req, model):
            async with limit:
                record = await send(session, args.base_url, args.endpoint, req, model,
                                    not args.no_ignore_eos, sampling_fields(args))
            progress.update(record)
            return record

        before = await spec_counters(session, args.base_url)
        start = time.perf_counter()
        tasks = []
        for i, (req, gap) in enumerate(zip(requests, gaps)):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(req, models[i % len(models)])))
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        return list(records), duration, speculation(before, await spec_counters(
            session, args.base_url))


def parse_slo(items: list[str] | None) -> dict:
    slo = {}
    for item in items or []:
        key, _, value = item.partition(":")
        if key not in ("ttft", "tpot", "e2e") or not value:
            raise SystemExit(f"--goodput takes ttft:MS tpot:MS, got {item!r}")
        slo[key] = float(value)
    return slo


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tritonserve bench serve")
    p.add_argument("--base-url", required=True)
    p.add_argument("--endpoint", choices=["native", "completions", "chat"], default="native")
    p.add_argument("--num-prompts", type=int, default=64)
    rate = p.add_mutually_exclusive_group()
    rate.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals/s")
    rate.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--input-len", type=int, default=100)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dataset", default="random", help="random; shared-prefix (--num-prefixes "
                   "system prompts of --prefix-len tokens, then --input-len of question); or "
                   "a JSONL file of prompts")
    p.add_argument("--num-prefixes", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--tokenizer", default=None, help="HF folder for token-length prompts")
    p.add_argument("--model", default=None, help="model name for the OpenAI routes; a "
                   "comma-separated list: the requests take them in turn (LoRA adapters)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--goodput", nargs="*", default=None, metavar="KEY:MS")
    p.add_argument("--result-json", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--no-ignore-eos", action="store_true")
    p.add_argument("--temperature", type=float, default=None,
                   help="sent with every request; without it, the server's default")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--timeout", type=float, default=3600)
    args = p.parse_args(argv)
    args.base_url = args.base_url.rstrip("/")

    if args.dataset in ("random", "shared-prefix"):
        tokenizer = None
        if args.tokenizer:
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        if args.dataset == "random":
            requests = random_requests(args.num_prompts, args.input_len, args.output_len,
                                       args.seed, tokenizer)
        else:
            requests = shared_prefix_requests(args.num_prompts, args.num_prefixes,
                                              args.prefix_len, args.input_len,
                                              args.output_len, args.seed, tokenizer)
    else:
        requests = jsonl_requests(args.dataset, args.num_prompts, args.output_len, args.seed)
    records, duration, spec = asyncio.run(run(args, requests))
    summary = summarize(records, duration, parse_slo(args.goodput))
    summary["speculation"] = spec
    print_table(summary, args)
    if spec is not None and spec["acceptance_rate"] is not None:
        print(f"speculation: {spec['acceptance_rate']:.1%} of {spec['num_draft_tokens']:.0f} "
              f"proposed tokens accepted, mean accepted length "
              f"{spec['mean_accepted_length']:.2f}")
    for record in records:
        if record.protocol_error:
            print(f"protocol error: {record.protocol_error}")
            break
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump({"args": vars(args), "summary": summary,
                       "requests": [r.to_dict() for r in records]}, f, indent=2)
    if args.plot:
        plot(records, args.plot)
    return 0 if summary["protocol_errors"] == 0 else 1
