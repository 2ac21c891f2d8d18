"""bench/gguf_table.py: issue 46's table from a gguf_figures.sh folder, each 1-stream cell's
floor at the read rate measured around it."""
import json
import subprocess
import sys

from tritonserve.bench import gguf_table


def _result(folder, name, tok_s, tpot, ttft=50.0, reads=None, tokens=512, core_ns=None):
    (folder / f"{name}.json").write_text(json.dumps(
        {"output_throughput": tok_s, "median_tpot_ms": tpot, "median_ttft_ms": ttft,
         "completed": 8, "total_output_tokens": tokens}))
    if reads is not None:
        core_ns = core_ns or [None] * len(reads)
        (folder / f"{name}.read.json").write_text("".join(
            json.dumps({"read_GB/s": r, "floor_1_stream_tok/s": r / 0.0964,
                        "core_to_core_ns": ns}) + "\n" for r, ns in zip(reads, core_ns)))


def test_ratios_and_the_floor_of_each_cells_own_minutes(tmp_path):
    _result(tmp_path, "ours_c1_greedy", 200.0, 4.0, reads=[30.0, 34.0], core_ns=[32.0, 35.0])
    _result(tmp_path, "ours_bf16_c1_greedy", 100.0, 9.0, reads=[60.0, 60.0],
            core_ns=[170.0, 106.0])
    _result(tmp_path, "llama_c1_greedy", 50.0, 15.0, reads=[40.0, 40.0])
    _result(tmp_path, "ours_c16_default", 600.0, 20.0)
    _result(tmp_path, "ours_bf16_c16_default", 500.0, 25.0)
    _result(tmp_path, "llama_c16_default", 9.0, 100.0, tokens=95)  # interrupted streams
    lines = gguf_table.table(tmp_path)
    row = next(line for line in lines if line.startswith("| 1 | greedy"))
    assert "200.0 (TPOT 4.00 ms)" in row and "4.00x" in row and "2.00x" in row
    row16 = next(line for line in lines if line.startswith("| 16 | default"))
    # llama.cpp streamed 95 of the 512 tokens: no ratio against it; ours / bf16 is 600 / 500
    assert "9.0 (95 of 512 tokens)" in row16 and row16.endswith("|  | 1.20x |")
    assert not any(line.startswith("| 64") for line in lines)  # cells never run are left out
    # ours' own reads (mean 32 GB/s) set its floor, not the other servers' minutes
    floor = 32.0 * 1e3 / gguf_table.FILE_MB
    note = next(line for line in lines if line.startswith("1 stream greedy"))
    assert f"floor {floor:.0f} tok/s" in note and "(one CCD)" in note
    assert "ours_bf16's cell: two CCDs" in note  # the other side of the ratio ran elsewhere
    assert f"{100 * 200.0 / floor:.0f} % of it by output tok/s" in note
    assert f"{100 * 250.0 / floor:.0f} % by TPOT" in note


def test_a_cell_without_reads_has_no_floor_line(tmp_path):
    _result(tmp_path, "ours_c1_default", 150.0, 5.0)
    lines = gguf_table.table(tmp_path)
    assert any(line.startswith("| 1 | default | 150.0") for line in lines)
    assert not any(line.startswith("1 stream") for line in lines)


def test_the_command_refuses_a_missing_folder(tmp_path):
    run = subprocess.run([sys.executable, "-m", "tritonserve", "bench", "gguf-table",
                          str(tmp_path / "nowhere")], capture_output=True, text=True)
    assert run.returncode == 2 and "out:" in run.stderr


def test_the_placement_of_each_cell(tmp_path):
    """The core-to-core latency around a cell names the vCPUs' placement (SPLIT_NS)."""
    for name, ns in [("ours_c1_default", [170.0, 160.0]), ("ours_c1_greedy", [33.0, 170.0])]:
        _result(tmp_path, name, 150.0, 5.0, reads=[55.0, 40.0], core_ns=ns)
    notes = [line for line in gguf_table.table(tmp_path) if line.startswith("1 stream")]
    assert "(two CCDs)" in notes[0] and "(moved between one and two CCDs)" in notes[1]
    # machine.sh without the C++ probe writes null: the placement is then not claimed
    _result(tmp_path, "ours_c1_default", 150.0, 5.0, reads=[55.0])
    notes = [line for line in gguf_table.table(tmp_path) if line.startswith("1 stream")]
    assert "(placement not measured)" in notes[0]


def test_the_one_stream_rounds_and_their_medians(tmp_path):
    """gguf_figures.sh's extra 1-stream rounds (NAME_rK): a row a round, the medians over
    every round, and over the rounds where ours and bf16 both stayed on one CCD."""
    one, two = [33.0, 34.0], [150.0, 160.0]
    rounds = [  # (ours tok/s, bf16 tok/s, ours' placement, bf16's placement)
        (220.0, 100.0, one, one), (200.0, 125.0, one, two), (210.0, 95.0, one, one)]
    for k, (ours, bf16, ours_ns, bf16_ns) in enumerate(rounds, start=1):
        suffix = "" if k == 1 else f"_r{k}"
        _result(tmp_path, f"ours_c1_greedy{suffix}", ours, 4.0, reads=[32.0, 32.0],
                core_ns=ours_ns)
        _result(tmp_path, f"ours_bf16_c1_greedy{suffix}", bf16, 9.0, reads=[32.0, 32.0],
                core_ns=bf16_ns)
        _result(tmp_path, f"llama_c1_greedy{suffix}", 60.0, 15.0, reads=[32.0, 32.0])
    lines = gguf_table.rounds_table(tmp_path)
    rows = [line for line in lines if line.startswith("| greedy |")]
    assert [row.split(" | ")[1] for row in rows] == ["1", "2", "3"]
    assert "1.60x" in rows[1] and "one CCD, two CCDs" in rows[1]
    every = next(line for line in lines if "median over every round" in line)
    # ours / bf16: 2.20, 1.60, 2.21 -> median 2.20; ours / llama: 210 / 60 is the median
    assert "(3 rounds)" in every and "ours / bf16 2.20x" in every
    assert f"ours / llama.cpp {210 / 60:.2f}x" in every
    floor = 32.0 * 1e3 / gguf_table.FILE_MB
    assert f"floor share {100 * 210.0 / floor:.0f} % by output tok/s" in every
    same = next(line for line in lines if "stayed on one CCD" in line)
    # rounds 1 and 3 only: the median of 2.20 and 2.21
    assert "(2 rounds)" in same and f"ours / bf16 {(2.2 + 210 / 95) / 2:.2f}x" in same
    # a run with one round has no rounds table
    for path in tmp_path.glob("*_r*.json"):
        path.unlink()
    assert gguf_table.rounds_table(tmp_path) == []
