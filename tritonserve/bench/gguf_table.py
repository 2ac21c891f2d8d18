"""`tritonserve bench gguf-table DIR`: issue 46's table from one gguf_figures.sh run (DIR: its
OUT). Reads the `vllm bench serve` results (NAME_cS_SAMPLING.json) and the read rates the
script measured around each 1-stream cell (NAME_c1_SAMPLING.read.json, before and after), and
prints docs/benchmarks.md's rows: output tok/s and TPOT a server and cell, the ratios, and
each 1-stream cell's share of the floor at the read rate of its own minutes (the file read
once a token), by output tok/s and by TPOT. On a VM whose read rate moves 2x within minutes,
a floor from the run's start or end says little about a cell run in between.

The 1-stream cells run in rounds (gguf_figures.sh's ROUNDS: round 1 is the table's cell,
round k NAME_c1_SAMPLING_rK, the servers alternated within each round): a 1-stream cell is
8 requests, ~2-7 s, and on that VM two such cells minutes apart moved 10 % with nothing
changed. The rounds table gives each round with its placement, then medians: over every round
and over the rounds in which ours and the bf16 conversion both stayed on one CCD."""
from __future__ import annotations

import argparse
import json
import statistics
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
    ratio = _ratio(a, b, full)
    return "" if ratio is None else f"{ratio:.2f}x"


def _ratio(a: Cell | None, b: Cell | None, full: int | None = None) -> float | None:
    """a / b in output tok/s, or None unless both streamed >= 90 % of `full` tokens (by
    default the larger of their counts)."""
    if a is None or b is None:
        return None
    if min(a.tokens, b.tokens) < 0.9 * (full or max(a.tokens, b.tokens)):
        return None
    return a.tok_s / b.tok_s


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


def rounds(out: Path, name: str) -> list[Cell | None]:
    """A 1-stream cell's rounds: NAME, then NAME_r2, NAME_r3 ... while they exist."""
    found = [load_cell(out, name)]
    while (out / f"{name}_r{len(found) + 1}.json").exists():
        found.append(load_cell(out, f"{name}_r{len(found) + 1}"))
    return found


def _medians(label: str, picked: list[tuple[Cell, Cell | None, Cell | None]]) -> str:
    """One summary line: the median ratios and floor shares of the picked rounds."""
    if not picked:
        return f"{label}: no round"
    llama = [r for r in (_ratio(o, ll) for o, _, ll in picked) if r is not None]
    bf16 = [r for r in (_ratio(o, b) for o, b, _ in picked) if r is not None]
    shares = [o.share() for o, _, _ in picked if o.read_gbps]
    parts = [f"{label} ({len(picked)} rounds): ours / llama.cpp "
             + (f"{statistics.median(llama):.2f}x" if llama else "-"),
             "ours / bf16 " + (f"{statistics.median(bf16):.2f}x" if bf16 else "-")]
    if shares:
        parts.append(f"floor share {100 * statistics.median(s[0] for s in shares):.0f} % by "
                     f"output tok/s, {100 * statistics.median(s[1] for s in shares):.0f} % "
                     f"by TPOT")
    return ", ".join(parts)


def rounds_table(out: Path) -> list[str]:
    """The 1-stream rounds (when the run made more than one): a row a round, then the
    medians over all rounds and over the rounds where ours and bf16 both stayed on one CCD."""
    lines = []
    for sampling in SAMPLINGS:
        runs = {s: rounds(out, f"{s}_c1_{sampling}") for s in SERVERS}
        count = max(len(r) for r in runs.values())
        if count < 2 or runs["ours"][0] is None:
            continue
        if not lines:
            lines = ["| sampling | round | ours (blocks) | ours bf16 | llama.cpp | ours / "
                     "llama.cpp | ours / bf16 | ours' floor share (tok/s, TPOT) | placement "
                     "(ours, bf16, llama.cpp) |", "|---|---|---|---|---|---|---|---|---|"]
        picked, one_ccd = [], []
        for k in range(count):
            ours, bf16, llama = (runs[s][k] if k < len(runs[s]) else None for s in SERVERS)
            if ours is None:
                continue
            picked.append((ours, bf16, llama))
            if ours.placement == "one CCD" and bf16 is not None and bf16.placement == "one CCD":
                one_ccd.append((ours, bf16, llama))
            share = ""
            if ours.read_gbps:
                by_rate, by_tpot = ours.share()
                share = f"{100 * by_rate:.0f} %, {100 * by_tpot:.0f} %"
            cells = " | ".join("" if c is None else f"{c.tok_s:.1f} (TPOT {c.tpot_ms:.2f})"
                               for c in (ours, bf16, llama))
            ratios = " | ".join("" if r is None else f"{r:.2f}x"
                                for r in (_ratio(ours, llama), _ratio(ours, bf16)))
            where = ", ".join("" if c is None else c.placement for c in (ours, bf16, llama))
            lines.append(f"| {sampling} | {k + 1} | {cells} | {ratios} | {share} | {where} |")
        lines.append(_medians(f"{sampling}, median over every round", picked))
        lines.append(_medians(f"{sampling}, median where ours and bf16 stayed on one CCD",
                              one_ccd))
    return lines


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tritonserve bench gguf-table", description=__doc__)
    parser.add_argument("out", type=Path, help="a gguf_figures.sh run's OUT folder")
    args = parser.parse_args(argv)
    if not args.out.is_dir():
        parser.error(f"out: {args.out} is not a folder")
    print("\n".join(table(args.out)))
    extra = rounds_table(args.out)
    if extra:
        print("\n1-stream rounds:\n" + "\n".join(extra))
    return 0
