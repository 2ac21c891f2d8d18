"""tritonserve bench priority --url URL: does a high-priority request start promptly while
a full cache serves many low-priority streams?

1. idle: a probe (a ~100-token prompt, 4 tokens, streamed) --rounds times on a quiet server:
   its median time to first token is the baseline;
2. --streams low-priority streams (priority 10, distinct prompts, --low-tokens tokens each,
   ignore_eos) fill the cache (start the server with --num-blocks small enough that they do
   not all fit: some wait, some are preempted);
3. while they run: the probe with priority -10, --rounds times, each noting how many low
   streams were in flight (started, not ended) when it was sent;
4. then the probe with priority 10 (what FCFS would give it), --rounds times: the first one
   may wait for most streams to end, so it comes last (run beside the high-priority rounds,
   it emptied the server under them).
Prints each phase's median and worst TTFT and the loaded / idle ratios. The target (issue
"The APIs agents and evaluators speak"): the high-priority probe within 2x its idle TTFT.
Every client is a thread with its own connection (http.client); the low streams' threads
run in a child process.
"""
from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import random
import statistics
import threading
import time
from urllib.parse import urlsplit

PROBE = ("Summarise the following in one word: paged attention stores the keys and values "
         "of every sequence in fixed-size blocks, so that memory is allocated on demand and "
         "shared between sequences that start alike. ")


def _stream(url: str, body: dict, first: threading.Event | None = None,
            ended: threading.Event | None = None, tokens: list | None = None
            ) -> tuple[float, float]:
    """(seconds to the first token event, seconds to the end) of one /generate stream;
    `tokens` gets one (time) per token event."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=3600)
    started = time.perf_counter()
    try:
        conn.request("POST", "/generate", body=json.dumps({**body, "stream": True}),
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
        ttft = None
        for line in response:
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[6:])
            if event["type"] == "token" and tokens is not None:
                tokens.append(time.perf_counter())
            if event["type"] == "token" and ttft is None:
                ttft = time.perf_counter() - started
                if first is not None:
                    first.set()
            elif event["type"] == "error":
                raise RuntimeError(f"error event: {event}")
        return ttft if ttft is not None else float("nan"), time.perf_counter() - started
    finally:
        conn.close()
        if ended is not None:
            ended.set()


def _probe(url: str, priority: int, pause: bool = True) -> float:
    # beside the streams, a pause of random length first: sent right after the previous
    # probe's last event, a probe would arrive as a step begins, every time (a real client's
    # arrival is not tied to the server's steps). Idle, none: back to back, the machine warm,
    # is the lower floor (a pause made the idle TTFT 64 ms, not 35)
    if pause:
        time.sleep(random.uniform(0.05, 0.25))
    return _stream(url, {"prompt": PROBE, "max_tokens": 4, "temperature": 0,
                         "ignore_eos": True, "priority": priority})[0]


def _lows(url: str, streams: int, low_tokens: int, started, ended, out) -> None:
    """The low-priority streams, each a thread, in a process of their own (so the probe does
    not queue for this bench's GIL behind 64 parsing threads); `started` / `ended` count
    them, `out` gets every stream's token times."""
    body = {"max_tokens": low_tokens, "temperature": 0, "ignore_eos": True, "priority": 10}
    times: list[list[float]] = [[] for _ in range(streams)]

    def one(i: int) -> None:
        first = threading.Event()
        threading.Thread(target=lambda: first.wait() and _add(started), daemon=True).start()
        try:
            _stream(url, {**body, "prompt": f"Story {i}: once upon a time in a town numbered "
                          f"{i * 7919},"}, first, None, times[i])
        finally:
            first.set()
            _add(ended)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    out.put(times)


def _add(counter) -> bool:
    with counter.get_lock():
        counter.value += 1
    return True


def run(url: str, streams: int = 64, low_tokens: int = 512, rounds: int = 5) -> dict:
    _probe(url, -10, False)  # warm-up (the first request pays one-time costs)
    idle = [_probe(url, -10, False) for _ in range(rounds)]
    ctx = multiprocessing.get_context("spawn")
    started, ended, out = ctx.Value("i", 0), ctx.Value("i", 0), ctx.Queue()
    t0 = time.perf_counter()  # perf_counter is the same clock in the child (CLOCK_MONOTONIC)
    lows = ctx.Process(target=_lows, args=(url, streams, low_tokens, started, ended, out))
    lows.start()
    while started.value < streams // 2:  # the cache is filling
        time.sleep(0.05)
    high, beside = [], []
    high_from = time.perf_counter()
    for _ in range(rounds):
        beside.append(started.value - ended.value)
        high.append(_probe(url, -10))
    high_to = time.perf_counter()
    fcfs = [_probe(url, 10) for _ in range(rounds)]
    running_at_end = streams - ended.value
    times = out.get()
    lows.join()
    idle_median = statistics.median(idle)
    ends = [t[-1] for t in times if t]
    during = sum(high_from <= t <= high_to for ts in times for t in ts)
    return {"streams": streams, "low_tokens": low_tokens, "rounds": rounds,
            "low_streams_still_running_after_the_probes": running_at_end,
            "low_streams_in_flight_at_each_high_probe": beside,
            "idle_ttft_s": idle, "high_ttft_s": high, "fcfs_ttft_s": fcfs,
            "high_over_idle_median": statistics.median(high) / idle_median,
            "high_over_idle_worst": max(high) / idle_median,
            "fcfs_over_idle_median": statistics.median(fcfs) / idle_median,
            # what the low streams got: overall, and while the high-priority probes ran
            "low_tok_s": sum(map(len, times)) / (max(ends) - t0) if ends else 0.0,
            "low_tok_s_during_high_probes": during / (high_to - high_from)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tritonserve bench priority")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--low-tokens", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    out = run(args.url, args.streams, args.low_tokens, args.rounds)
    ms = lambda values: f"median {statistics.median(values) * 1e3:.0f} ms, worst " \
                        f"{max(values) * 1e3:.0f} ms"  # noqa: E731
    print(f"idle probe TTFT:                    {ms(out['idle_ttft_s'])}")
    print(f"priority -10 beside {out['streams']} streams: {ms(out['high_ttft_s'])} "
          f"({out['high_over_idle_median']:.2f}x idle, worst {out['high_over_idle_worst']:.2f}x)")
    print(f"priority 10 (FCFS) beside them:     {ms(out['fcfs_ttft_s'])} "
          f"({out['fcfs_over_idle_median']:.2f}x idle)")
    print(f"low streams in flight at each priority -10 probe: "
          f"{out['low_streams_in_flight_at_each_high_probe']}; still running at the end: "
          f"{out['low_streams_still_running_after_the_probes']}")
    print(f"low streams' tokens/s: {out['low_tok_s']:.0f} overall, "
          f"{out['low_tok_s_during_high_probes']:.0f} during the priority -10 probes")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0
