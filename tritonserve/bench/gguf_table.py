"""`tritonserve bench gguf-table DIR`: issue 46's table from one gguf_figures.sh run (DIR: its
OUT). Reads the `vllm bench serve` results (NAME_cS_SAMPLING.json) and the read rates the
script measured around each 1-stream cell (NAME_c1_SAMPLING.read.json, before and after), and
prints docs/benchmarks.md's rows: output tok/s and TPOT a server and cell, the ratios, and
each 1-stream cell's share of the floor at the read rate of its own minutes (the file read
once a token), by output tok/s and by TPOT. On a VM whose read rate moves 2x within minutes,
a floor from the run's start or end says little about a cell run in between."""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

SERVERS = ("ours", "ours_bf16", "llama")
SAMPLINGS = ("default", "greedy")
FILE_MB = 96.4  # the embedded GGUF's bytes read a token (Q4_1 layers + the Q8_0 head)
# core-to-core latency above which the two vCPUs sit on different CCDs: 31-35 ns on one CCD
# and 106-181 on two on the Zen 4 VM of docs/benchmarks.md ("Two machines in one VM")
SPLIT_NS = 70.0


@dataclass(frozen=True)
class Cell:
    tok_s: float  # output tok/s
    tpot_ms: float  # median
    ttft_ms: float  # median
    read_gbps: tuple[float, ...]  # measured before / after the cell (1-stream cells)
    tokens: int  # output tokens streamed in all
    core_ns: tuple[float, ...] = ()  # core-to-core latency before / after (1-stream cells)

    @property
    def placement(self) -> str:
        """one CCD, two CCDs, or moved (the two vCPUs' placement changed during the cell)"""
        split = {ns > SPLIT_NS for ns in self.core_ns}
        if not split:
            return "placement not measured"
        return "moved between one and two CCDs" if len(split) == 2 else (
            "two CCDs" if split.pop() else "one CCD")

    @property
    def floor_tok_s(self) -> float:
        """The file read once a token at the mean read rate around the cell."""
        read = sum(self.read_gbps) / len(self.read_gbps)
        return read * 1e3 / FILE_MB

    def share(self) -> tuple[float, float]:
        """(by output tok/s, by TPOT) as fractions of the cell's floor."""
        floor = self.floor_tok_s
        return self.tok_s / floor, 1e3 / self.tpot_ms / floor


def load_cell(out: Path, name: str) -> Cell | None:
    path = out / f"{name}.json"
    if not path.exists():
        return None
    result = json.loads(path.read_text())
    machine = []
    read_path = out / f"{name}.read.json"
    if read_path.exists():
        machine = [json.loads(line) for line in read_path.read_text().splitlines()
                   if line.strip()]
    return Cell(result["output_throughput"], result["median_tpot_ms"],
                result["median_ttft_ms"], tuple(m["read_GB/s"] for m in machine),
                result["total_output_tokens"],
                tuple(m["core_to_core_ns"] for m in machine
                      if m.get("core_to_core_ns") is not None))


def pair(a: Cell | None, b: Cell | None, full: int) -> str:
    """a / b in output tok/s, where both streamed nearly every token (llama.cpp's server
    interrupts a stream when another request comes: its tok/s is then not the same work; it
    also ends a stream at EOS now and then, which leaves the rate comparable)."""
    if a is None or b is None or min(a.tokens, b.tokens) < 0.9 * full:
        return ""
    return f"{a.tok_s / b.tok_s:.2f}x"


def table(out: Path) -> list[str]:
    """The markdown rows (header first) and, after them, the 1-stream floor lines."""
    rows = ["| streams | sampling | ours (blocks) | ours bf16 conversion | llama.cpp "
            "| ours / llama.cpp | ours / bf16 |", "|---|---|---|---|---|---|---|"]
    notes = []
    for streams in (1, 16, 64):
        for sampling in SAMPLINGS:
            cells = {s: load_cell(out, f"{s}_c{streams}_{sampling}") for s in SERVERS}
            if all(c is None for c in cells.values()):
                continue
            full = max(c.tokens for c in cells.values() if c is not None)
            shown = []
            for server in SERVERS:
                c = cells[server]
                shown.append("" if c is None else f"{c.tok_s:.1f}" + (
                    f" (TPOT {c.tpot_ms:.2f} ms)" if streams == 1 else "") + (
                    f" ({c.tokens} of {full} tokens)" if c.tokens < full else ""))
            rows.append(f"| {streams} | {sampling} | " + " | ".join(shown) + " | "
                        f"{pair(cells['ours'], cells['llama'], full)} | "
                        f"{pair(cells['ours'], cells['ours_bf16'], full)} |")
            ours = cells["ours"]
            if streams == 1 and ours is not None and ours.read_gbps:
                by_rate, by_tpot = ours.share()
                reads = " / ".join(f"{r:.1f}" for r in ours.read_gbps)
                notes.append(f"1 stream {sampling}: read {reads} GB/s around the cell "
                             f"({ours.placement}), floor "
                             f"{ours.floor_tok_s:.0f} tok/s; ours {100 * by_rate:.0f} % of it "
                             f"by output tok/s, {100 * by_tpot:.0f} % by TPOT "
                             f"(TTFT {ours.ttft_ms:.1f} ms)" + "".join(
                                 f"; {server}'s cell: {cells[server].placement}"
                                 for server in SERVERS[1:] if cells[server] is not None
                                 and cells[server].core_ns))
    return rows + [""] + notes


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tritonserve bench gguf-table", description=__doc__)
    parser.add_argument("out", type=Path, help="a gguf_figures.sh run's OUT folder")
    args = parser.parse_args(argv)
    if not args.out.is_dir():
        parser.error(f"out: {args.out} is not a folder")
    print("\n".join(table(args.out)))
    return 0
