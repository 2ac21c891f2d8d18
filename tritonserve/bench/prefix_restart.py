"""tritonserve bench prefix-restart: what the prefix cache's disk tier (--prefix-cache-dir)
saves a prompt seen before a restart.

Starts `tritonserve serve` with a fresh --prefix-cache-dir, streams one --input-len-token prompt
(random token ids, fixed seed) to /v1/completions three times: cold, again (a memory hit),
then once more after a SIGTERM and a new start on the same folder (read from disk). Prints
each TTFT, the ratio restart / cold (the target, issue "Long context": <= 0.20), the folder's
size and the second start-up's time. Sampling is the server's default (temperature unset)
unless --greedy. Server options after `--` (e.g. `-- --model m.gguf --dtype bfloat16`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from .client import send
from .workload import random_requests


def start_server(port: int, folder: str, extra: list[str]) -> tuple[subprocess.Popen, float]:
    """The server process and the seconds until it printed READY."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "tritonserve", "serve", "--port", str(port),
                             "--prefix-cache-dir", folder, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if "prefix cache dir" in line or "error" in line.lower():
            print("  server:", line.rstrip().split(" INFO ")[-1])
        if line.startswith("READY"):
            return proc, time.perf_counter() - start
    raise RuntimeError(f"the server exited ({proc.wait()}) before READY")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)  # drains, then the disk writer finishes its files
    proc.communicate(timeout=300)


async def ttft(url: str, request, sampling: dict) -> float:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        record = await send(session, url, "completions", request, None, True, sampling)
    if not record.ok:
        raise RuntimeError(f"request failed: {record.error or record.protocol_error}")
    return record.ttft_s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tritonserve bench prefix-restart")
    p.add_argument("--port", type=int, default=8190)
    p.add_argument("--input-len", type=int, default=4096)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--dir", default=None, help="the prefix cache folder (default: a temp one, "
                   "removed after)")
    p.add_argument("--json", default=None)
    args, extra = p.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    folder = args.dir or tempfile.mkdtemp(prefix="prefix-restart-")
    from transformers import AutoTokenizer
    from tritonserve.engine.default_model import resolve_model
    model = next((extra[i + 1] for i, a in enumerate(extra[:-1]) if a == "--model"), None)
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(model)))
    request = random_requests(1, args.input_len, args.output_len, seed=0, tokenizer=tokenizer)[0]
    sampling = {"temperature": 0.0} if args.greedy else {}
    url = f"http://127.0.0.1:{args.port}"
    rows = {}
    try:
        proc, rows["start_s"] = start_server(args.port, folder, extra)
        try:
            rows["cold_s"] = asyncio.run(ttft(url, request, sampling))
            rows["memory_hit_s"] = asyncio.run(ttft(url, request, sampling))
        finally:
            stop_server(proc)
        rows["folder_mb"] = sum(f.stat().st_size for f in Path(folder).rglob("*.kv")) / 2**20
        proc, rows["restart_start_s"] = start_server(args.port, folder, extra)
        try:
            rows["restart_s"] = asyncio.run(ttft(url, request, sampling))
        finally:
            stop_server(proc)
    finally:
        if args.dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    rows["ratio"] = rows["restart_s"] / rows["cold_s"]
    print(f"prompt {args.input_len} tokens, {'greedy' if args.greedy else 'default sampling'}")
    print(f"  TTFT cold {rows['cold_s']:.2f} s, memory hit {rows['memory_hit_s']:.3f} s, "
          f"after a restart {rows['restart_s']:.3f} s: {rows['ratio']:.3f} of cold "
          f"(target <= 0.20)")
    print(f"  folder {rows['folder_mb']:.0f} MiB; start-up {rows['start_s']:.1f} s, "
          f"then {rows['restart_start_s']:.1f} s with the folder")
    if args.json:
        Path(args.json).write_text(json.dumps({**vars(args), "server": extra, **rows}, indent=2))
    return 0
