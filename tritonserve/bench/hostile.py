"""tritonserve bench hostile --url URL: does one hostile client hurt the others?

A prober asks /health every --health-every seconds throughout, and a neighbour streams 64
tokens greedily (its quiet time is measured first, with the prober on). Three phases:
1. the short bodies, each sent once in the middle of one neighbour stream, --repeat rounds: a
   480-level nested schema, 20,000 choices, a grammar at the size limit (it compiles, off the
   event loop), 40,000 stop strings, 120,000 messages; each neighbour stream against quiet;
2. an ordinary stream of --tool-tokens tokens, the neighbour streaming again and again beside
   it: the baseline for phase 3, since a neighbour that shares steps with a long context pays
   its attention, hostile or not;
3. a tool call streamed for --tool-tokens tokens (its arguments were scanned from the start at
   every delta: 8,000 tokens cost 6.1 s of the event loop); the neighbour against phase 2.
Not measured here: a client flooding the server with bodies back to back, which on a 2-core
machine takes cores from the engine whatever the bodies are (docs/perf-log/
2026-12-06-hostile-requests.md); that is per-client rate limiting's job.
Prints each body's answer, /health's p50 / p99 / max, and the neighbour's median and worst
in each phase with its ratio. The targets (issue "No request can freeze the others"): /health
p99 under 100 ms, the neighbour's worst stream within 2x its baseline, for one engine and for
`-dp 2`.

Every client is a thread with its own connection (http.client), and every body is serialized
before the clock starts, so the client's own work does not land in what it measures.
"""
from __future__ import annotations

import argparse
import http.client
import json
import statistics
import threading
import time
from urllib.parse import urlsplit

NEIGHBOUR = {"prompt": "Write a short story about a lighthouse keeper.", "max_tokens": 64,
             "temperature": 0, "ignore_eos": True, "stream": True}


def _nested_schema(levels: int) -> str:
    """The schema's JSON text, written as text: json.dumps of the nested dicts hits Python's
    recursion limit near 480 levels."""
    text = '{"type": "string"}'
    for i in range(levels):
        text = f'{{"type": "object", "properties": {{"a{i}": {text}}}, "required": ["a{i}"]}}'
    return text


_SCHEMA = "@schema@"  # where the nested schema's text goes
TOOL_PHASE = "tool call"


def _choices(count: int) -> list[str]:
    return [f"choice number {i} xyz" for i in range(count)]


def hostile_bodies(tool_tokens: int) -> list[tuple[str, list[tuple[str, str, bytes]]]]:
    """The phases: (name, [(body name, path, serialized body)])."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    long_ask = [{"role": "user", "content": "Write a very long text."}]
    # minLength keeps the model writing the arguments until max_tokens (it closed the string
    # after ~15 tokens without it)
    write = {"type": "function", "function": {"name": "write", "parameters": {
        "type": "object", "properties": {"text": {"type": "string", "minLength": 10 ** 6}},
        "required": ["text"]}}}
    phases = [
        ("short bodies", [
            ("nested schema, 480 levels", "/v1/chat/completions", {**chat, "response_format": {
                "type": "json_schema", "json_schema": {"name": "deep", "schema": _SCHEMA}}}),
            ("guided_choice, 20,000 strings", "/v1/completions",
             {"prompt": "x", "max_tokens": 8, "guided_choice": _choices(20_000)}),
            ("guided_choice at the size limit (compiles)", "/v1/completions",
             {"prompt": "x", "max_tokens": 8, "guided_choice": _choices(2_500)}),
            ("stop, 40,000 strings", "/v1/completions",
             {"prompt": "x", "max_tokens": 8, "stop": [f"stop {i}" for i in range(40_000)]}),
            ("messages, 120,000 empty", "/v1/chat/completions",
             {"messages": [{"role": "user", "content": ""}] * 120_000, "max_tokens": 8})]),
        ("ordinary long stream", [
            (f"plain stream, {tool_tokens} tokens", "/v1/chat/completions",
             {"messages": long_ask, "max_tokens": tool_tokens, "ignore_eos": True,
              "temperature": 0, "stream": True})]),
        (TOOL_PHASE, [
            (f"tool call streamed, {tool_tokens} tokens", "/v1/chat/completions",
             {"messages": long_ask, "tools": [write], "tool_choice": "required",
              "max_tokens": tool_tokens, "temperature": 0, "stream": True})]),
    ]
    return [(phase, [(name, path, json.dumps(body).replace(
        f'"{_SCHEMA}"', _nested_schema(480)).encode()) for name, path, body in bodies])
        for phase, bodies in phases]


class Client:
    def __init__(self, url: str, timeout: float = 600) -> None:
        parts = urlsplit(url)
        self.host, self.port, self.timeout = parts.hostname, parts.port or 80, timeout

    def call(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            conn.request(method, path, body=body,
                         headers={"Content-Type": "application/json"} if body else {})
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()


def neighbour_once(client: Client) -> tuple[float, float]:
    """(start, end) perf_counter of one 64-token stream; raises unless it ended with done."""
    started = time.perf_counter()
    status, raw = client.call("POST", "/generate", json.dumps(NEIGHBOUR).encode())
    ended = time.perf_counter()
    last = [line for line in raw.decode().split("\n") if line.startswith("data: ")][-1]
    if status != 200 or json.loads(last[6:]).get("type") != "done":
        raise RuntimeError(f"the neighbour's stream failed: {status} {last[:200]}")
    return started, ended


def _loop(stop: threading.Event, every: float, fn, out: list) -> None:
    while not stop.is_set():
        out.append(fn())
        if every:
            stop.wait(every)


def _health(client: Client) -> tuple[float, float, int]:
    started = time.perf_counter()
    status, _ = client.call("GET", "/health")
    return started, time.perf_counter(), status


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _within(spans: list, start: float, end: float) -> list[float]:
    """The durations of the spans that overlap [start, end]."""
    return [b - a for a, b, *_ in spans if a < end and b > start]


def _beside_neighbour(client: Client, path: str, body: bytes) -> tuple[dict, float]:
    """Sends `body` once, a moment into one neighbour stream. -> (answer, neighbour's s)."""
    span: list = []
    neighbour = threading.Thread(target=lambda: span.append(neighbour_once(client)),
                                 daemon=True)
    neighbour.start()
    time.sleep(0.05)  # its prefill has started; the body lands mid-stream
    started = time.perf_counter()
    status, raw = client.call("POST", path, body)
    answer = {"status": status, "seconds": time.perf_counter() - started,
              "events": raw.count(b"\ndata: ") + raw.startswith(b"data: ")}
    neighbour.join()
    return answer, span[0][1] - span[0][0]


def run(url: str, quiet_rounds: int = 5, tool_tokens: int = 8000, repeat: int = 3,
        health_every: float = 0.02) -> dict:
    client = Client(url)
    stop = threading.Event()
    probes: list[tuple[float, float, int]] = []
    prober = threading.Thread(target=_loop, args=(stop, health_every,
                                                  lambda: _health(client), probes), daemon=True)
    prober.start()
    answers, phases = [], []
    try:
        quiet = [b - a for a, b in (neighbour_once(client) for _ in range(quiet_rounds))]
        quiet_median = statistics.median(quiet)
        (short, bodies), *long_phases = hostile_bodies(tool_tokens)
        begun, beside = time.perf_counter(), []
        for _ in range(repeat):
            for name, path, body in bodies:
                answer, took = _beside_neighbour(client, path, body)
                answers.append({"phase": short, "body": name, "bytes": len(body), **answer})
                beside.append(took)
        phases.append((short, begun, time.perf_counter(), beside, quiet_median))
        for phase, bodies in long_phases:  # the neighbour streams again and again beside
            streamer_stop, spans = threading.Event(), []
            streamer = threading.Thread(target=_loop, args=(
                streamer_stop, 0, lambda: neighbour_once(client), spans), daemon=True)
            begun = time.perf_counter()
            streamer.start()
            for name, path, body in bodies:
                started = time.perf_counter()
                status, raw = client.call("POST", path, body)
                answers.append({"phase": phase, "body": name, "bytes": len(body),
                                "status": status, "seconds": time.perf_counter() - started,
                                "events": raw.count(b"\ndata: ") + raw.startswith(b"data: ")})
            streamer_stop.set()
            streamer.join(timeout=600)
            times = [b - a for a, b in spans]
            base = quiet_median  # the ordinary long stream's; the tool call's is that phase's
            if phase == TOOL_PHASE and phases[-1][3]:
                base = statistics.median(phases[-1][3])
            phases.append((phase, begun, time.perf_counter(), times, base))
    finally:
        stop.set()
        prober.join(timeout=60)
    out = {"quiet_s": quiet, "answers": answers, "probes": len(probes),
           "health_not_200": sum(1 for *_, s in probes if s != 200), "phases": []}
    latencies = [b - a for a, b, _ in probes]
    out.update(health_p50_ms=_percentile(latencies, 0.5) * 1e3,
               health_p99_ms=_percentile(latencies, 0.99) * 1e3,
               health_max_ms=max(latencies) * 1e3)
    for phase, begun, ended, times, base in phases:
        health = _within(probes, begun, ended)
        out["phases"].append({
            "phase": phase, "seconds": ended - begun, "neighbour_streams": len(times),
            "neighbour_median_s": statistics.median(times) if times else None,
            "neighbour_worst_s": max(times) if times else None, "baseline_s": base,
            "neighbour_worst_x": max(times) / base if times else None,
            "neighbour_p90_s": _percentile(times, 0.9) if times else None,
            "neighbour_s": times,
            "health_p99_ms": _percentile(health, 0.99) * 1e3 if health else None})
    return out


def _figure(value: float | None, spec: str) -> str:
    """A phase shorter than the probes' period has no /health figure of its own."""
    return "-" if value is None else format(value, spec)


def report(result: dict) -> list[str]:
    quiet = statistics.median(result["quiet_s"])
    lines = [f"quiet neighbour (64 tokens, greedy): median {quiet:.3f} s over "
             f"{len(result['quiet_s'])}"]
    for phase in result["phases"]:
        answers = [a for a in result["answers"] if a["phase"] == phase["phase"]]
        lines.append(f"{phase['phase']} ({phase['seconds']:.1f} s):")
        seen = set()
        for a in answers:
            if a["body"] in seen:
                continue
            seen.add(a["body"])
            same = [b for b in answers if b["body"] == a["body"]]
            lines.append(f"  {a['body']}: {a['bytes'] / 1e3:.0f} KB -> HTTP "
                         f"{'/'.join(sorted({str(b['status']) for b in same}))}, worst "
                         f"{max(b['seconds'] for b in same):.2f} s of {len(same)} "
                         f"({a['events']} SSE events)")
        if phase["neighbour_streams"]:
            lines.append(f"  neighbour: {phase['neighbour_streams']} streams, median "
                         f"{phase['neighbour_median_s']:.3f} s, p90 "
                         f"{phase['neighbour_p90_s']:.3f} s, worst "
                         f"{phase['neighbour_worst_s']:.3f} s = "
                         f"{phase['neighbour_worst_x']:.2f}x its baseline "
                         f"{phase['baseline_s']:.3f} s; /health p99 "
                         f"{_figure(phase['health_p99_ms'], '.1f')} ms")
    lines.append(f"/health over all: {result['probes']} probes, p50 "
                 f"{result['health_p50_ms']:.1f} ms, p99 {result['health_p99_ms']:.1f} ms, max "
                 f"{result['health_max_ms']:.1f} ms, {result['health_not_200']} not 200")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tritonserve bench hostile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--quiet-rounds", type=int, default=5)
    p.add_argument("--tool-tokens", type=int, default=8000)
    p.add_argument("--repeat", type=int, default=3,
                   help="rounds of the short bodies, each body once a round")
    p.add_argument("--health-every", type=float, default=0.02)
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args(argv)
    result = run(args.url, args.quiet_rounds, args.tool_tokens, args.repeat, args.health_every)
    print("\n".join(report(result)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0
