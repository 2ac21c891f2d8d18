"""tritonserve bench embed-share --url URL: what embedding traffic costs generation streams.

1. --streams generation streams (greedy, --tokens each, ignore_eos) alone: their time per
   output token (TPOT, median over streams);
2. the same streams again while a client sends /v1/embeddings batches (--batch distinct texts
   of about --text-tokens tokens each) back to back: their TPOT, and the embeddings' input
   tokens per second meanwhile.
An embedding request is an ordinary prefill in the same steps (engine/pooling.py): the
streams slow by the steps' extra rows, which the embeddings' token throughput pays for.
Prints both TPOTs, their ratio, and the embedding rate.
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

from .hostile import Client


def _post(url: str, path: str, body: dict) -> tuple[int, bytes]:
    return Client(url, timeout=3600).call("POST", path, json.dumps(body).encode())


def _tpot(url: str, tokens: int, i: int) -> float:
    """A stream's seconds per output token after its first (the done event's timing)."""
    status, raw = _post(url, "/generate", {
        "prompt": f"Write story number {i} about a lighthouse.", "max_tokens": tokens,
        "temperature": 0, "ignore_eos": True, "stream": True})
    done = json.loads([line for line in raw.decode().split("\n")
                       if line.startswith("data: ")][-1][6:])
    if status != 200 or done.get("type") != "done":
        raise RuntimeError(f"a stream failed: {status} {done}")
    return (done["total_ms"] - done["ttft_ms"]) / 1e3 / max(done["output_tokens"] - 1, 1)


def _streams(url: str, streams: int, tokens: int) -> list[float]:
    out: list[float] = []
    threads = [threading.Thread(target=lambda i=i: out.append(_tpot(url, tokens, i)))
               for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def run(url: str, streams: int = 4, tokens: int = 128, batch: int = 16,
        text_tokens: int = 64) -> dict:
    _streams(url, 1, 8)  # warm-up
    alone = _streams(url, streams, tokens)
    stop, embedded, seconds = threading.Event(), [0], [0.0]

    def embed() -> None:
        started, sent = time.perf_counter(), 0
        while not stop.is_set():
            texts = []  # distinct texts: no prefix-cache hit makes the work vanish
            for _ in range(batch):
                sent += 1
                texts.append(f"{sent}: " + " ".join(f"w{sent}x{i}" for i in range(
                    text_tokens // 3)))  # ~3 tokens a word
            status, raw = _post(url, "/v1/embeddings", {"input": texts})
            if status != 200:
                raise RuntimeError(f"embeddings failed: {status} {raw[:200]!r}")
            embedded[0] += json.loads(raw)["usage"]["prompt_tokens"]
        seconds[0] = time.perf_counter() - started

    embedder = threading.Thread(target=embed, daemon=True)
    embedder.start()
    time.sleep(0.5)
    beside = _streams(url, streams, tokens)
    stop.set()
    embedder.join()
    tpot_alone, tpot_beside = statistics.median(alone), statistics.median(beside)
    return {"streams": streams, "tokens": tokens, "batch": batch, "text_tokens": text_tokens,
            "tpot_alone_s": alone, "tpot_beside_s": beside,
            "tpot_ratio": tpot_beside / tpot_alone,
            "embedding_tokens_per_s": embedded[0] / seconds[0] if seconds[0] else 0.0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tritonserve bench embed-share")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--text-tokens", type=int, default=64)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    out = run(args.url, args.streams, args.tokens, args.batch, args.text_tokens)
    print(f"TPOT alone: {statistics.median(out['tpot_alone_s']) * 1e3:.1f} ms; beside "
          f"embeddings: {statistics.median(out['tpot_beside_s']) * 1e3:.1f} ms "
          f"({out['tpot_ratio']:.2f}x); embeddings meanwhile: "
          f"{out['embedding_tokens_per_s']:.0f} input tokens/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0
