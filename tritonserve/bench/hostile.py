"""tritonserve bench hostile --url URL: does one hostile client hurt the others?

While one client sends each hostile body in turn (a 480-level nested schema, 20,000 choices, a
grammar at the size limit that compiles, 40,000 stop strings, 120,000 messages, a tool call
streamed for --tool-tokens tokens), a prober asks /health every --health-every seconds and a
neighbour streams 64 tokens greedily, again and again. Prints each body's answer, /health's
p50 / p99 / max and the neighbour's times against its quiet ones (measured first, alone).
The targets (issue "No request can freeze the others"): /health p99 under 100 ms, the
neighbour's worst stream within 2x its quiet median, for one engine and for `-dp 2`.

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


def _choices(count: int) -> list[str]:
    return [f"choice number {i} xyz" for i in range(count)]


def hostile_bodies(tool_tokens: int) -> list[tuple[str, str, bytes]]:
    """(name, path, serialized body): each one a way one request used to hurt the others."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    write = {"type": "function", "function": {"name": "write", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}
    bodies = [
        ("nested schema, 480 levels", "/v1/chat/completions", {**chat, "response_format": {
            "type": "json_schema", "json_schema": {"name": "deep", "schema": _SCHEMA}}}),
        ("guided_choice, 20,000 strings", "/v1/completions",
         {"prompt": "x", "max_tokens": 8, "guided_choice": _choices(20_000)}),
        ("guided_choice at the size limit (compiles)", "/v1/completions",
         {"prompt": "x", "max_tokens": 8, "guided_choice": _choices(2_500)}),
        ("stop, 40,000 strings", "/v1/completions",
         {"prompt": "x", "max_tokens": 8, "stop": [f"stop {i}" for i in range(40_000)]}),
        ("messages, 120,000 empty", "/v1/chat/completions",
         {"messages": [{"role": "user", "content": ""}] * 120_000, "max_tokens": 8}),
        (f"tool call streamed, {tool_tokens} tokens", "/v1/chat/completions",
         {"messages": [{"role": "user", "content": "Write a very long text."}],
          "tools": [write], "tool_choice": "required", "max_tokens": tool_tokens,
          "temperature": 0, "stream": True}),
    ]
    return [(name, path, json.dumps(body).replace(f'"{_SCHEMA}"', _nested_schema(480)).encode())
            for name, path, body in bodies]


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


def neighbour_once(client: Client) -> float:
    """Seconds for one 64-token stream; raises when it did not end with `done`."""
    started = time.perf_counter()
    status, raw = client.call("POST", "/generate", json.dumps(NEIGHBOUR).encode())
    took = time.perf_counter() - started
    last = [line for line in raw.decode().split("\n") if line.startswith("data: ")][-1]
    if status != 200 or json.loads(last[6:]).get("type") != "done":
        raise RuntimeError(f"the neighbour's stream failed: {status} {last[:200]}")
    return took


def _loop(stop: threading.Event, every: float, fn, out: list) -> None:
    while not stop.is_set():
        out.append(fn())
        if every:
            stop.wait(every)


def _health(client: Client) -> tuple[float, int]:
    started = time.perf_counter()
    status, _ = client.call("GET", "/health")
    return time.perf_counter() - started, status


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def run(url: str, quiet_rounds: int = 3, tool_tokens: int = 8000,
        health_every: float = 0.02) -> dict:
    client = Client(url)
    quiet = [neighbour_once(client) for _ in range(quiet_rounds)]
    bodies = hostile_bodies(tool_tokens)
    stop = threading.Event()
    probes: list[tuple[float, int]] = []
    streams: list[float] = []
    threads = [threading.Thread(target=_loop, args=(stop, health_every, lambda: _health(client),
                                                    probes), daemon=True),
               threading.Thread(target=_loop, args=(stop, 0, lambda: neighbour_once(client),
                                                    streams), daemon=True)]
    for thread in threads:
        thread.start()
    answers = []
    try:
        for name, path, body in bodies:
            started = time.perf_counter()
            status, raw = client.call("POST", path, body)
            answers.append({"body": name, "bytes": len(body), "status": status,
                            "seconds": time.perf_counter() - started,
                            "events": raw.count(b"\ndata: ") + raw.startswith(b"data: ")})
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=600)
    latencies = [t for t, _ in probes]
    quiet_median = statistics.median(quiet)
    return {"quiet_s": quiet, "answers": answers, "probes": len(probes),
            "health_not_200": sum(1 for _, s in probes if s != 200),
            "health_p50_ms": _percentile(latencies, 0.5) * 1e3,
            "health_p99_ms": _percentile(latencies, 0.99) * 1e3,
            "health_max_ms": max(latencies) * 1e3,
            "neighbour_streams": len(streams),
            "neighbour_median_s": statistics.median(streams) if streams else None,
            "neighbour_worst_s": max(streams) if streams else None,
            "neighbour_worst_x": max(streams) / quiet_median if streams else None}


def report(result: dict) -> list[str]:
    quiet = statistics.median(result["quiet_s"])
    lines = [f"quiet neighbour (64 tokens, greedy): median {quiet:.3f} s over "
             f"{len(result['quiet_s'])}", "hostile bodies, in turn:"]
    for a in result["answers"]:
        lines.append(f"  {a['body']}: {a['bytes'] / 1e3:.0f} KB -> HTTP {a['status']} in "
                     f"{a['seconds']:.2f} s ({a['events']} SSE events)")
    lines.append(f"/health meanwhile: {result['probes']} probes, p50 "
                 f"{result['health_p50_ms']:.1f} ms, p99 {result['health_p99_ms']:.1f} ms, max "
                 f"{result['health_max_ms']:.1f} ms, {result['health_not_200']} not 200")
    if result["neighbour_streams"]:
        lines.append(f"neighbour meanwhile: {result['neighbour_streams']} streams, median "
                     f"{result['neighbour_median_s']:.3f} s, worst "
                     f"{result['neighbour_worst_s']:.3f} s = "
                     f"{result['neighbour_worst_x']:.2f}x its quiet median")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tritonserve bench hostile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--quiet-rounds", type=int, default=3)
    p.add_argument("--tool-tokens", type=int, default=8000)
    p.add_argument("--health-every", type=float, default=0.02)
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args(argv)
    result = run(args.url, args.quiet_rounds, args.tool_tokens, args.health_every)
    print("\n".join(report(result)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0
