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
