"""The C++ CPU ops (kernels/cpu/__init__.py): the paged decode attention against the torch
reference, the rope ops, the fake implementations, the benchmarks that drive them, and the
fallback when they cannot be built. The bf16 panel matmul: tests/test_cpu_panels_bf16.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tritonserve.engine.attention import CpuAttention
from tritonserve.kernels import cpu
from tritonserve.kernels import reference
from tritonserve.kernels.cpu import build as cpu_build
from tests.test_kernels_attention import (PREFILL_CASES, close, make_cache, poison_tails,
                                          scattered_tables)

op = cpu.op("paged_decode_attention")
needs_op = pytest.mark.skipif(op is None, reason="no C++ toolchain: the torch path serves")

CASES = [
    # (group, seq_lens, block_size, head_dim, dtype)
    (1, [1, 16, 37], 16, 64, torch.float32),
    (3, [5, 200, 64, 70], 16, 64, torch.float32),  # SmolLM2's 9 / 3 heads
    (4, [300, 1, 33], 32, 128, torch.float32),
    (2, [40, 7], 16, 96, torch.float32),  # a head size with no specialised build
    (3, [5, 20, 9], 8, 64, torch.float32),  # a block size the 16-token score tree skips
    (3, [48, 9, 130], 16, 64, torch.bfloat16),
    (4, [48, 9], 16, 128, torch.float16),
    # 40 sequences: at batch >= 4 x threads a work item is a whole sequence (all KV heads)
    (3, list(range(1, 400, 10)), 16, 64, torch.float32),
    (2, list(range(3, 200, 5)), 32, 96, torch.float32),
    (4, list(range(1, 120, 3)), 16, 128, torch.bfloat16),
    # bf16 with AVX512-BF16: pages of 32 (two 16-token groups, the second part-filled), the
    # groups the build instantiates (1-8); then what it leaves to the portable path
    (1, [1, 16, 17, 33, 64], 32, 64, torch.bfloat16),
    (7, [100, 3], 16, 128, torch.bfloat16),
    (8, [50, 15], 16, 64, torch.bfloat16),
    (2, [40, 7], 16, 96, torch.bfloat16),
    (3, [5, 20, 9], 8, 64, torch.bfloat16),
    (9, [30, 2], 16, 64, torch.bfloat16),
    (4, [100, 37, 5], 16, 256, torch.bfloat16),  # Gemma 2 / 3's head size
    (2, [70, 9], 16, 256, torch.float32),
    # one or two sequences past 256 tokens: their pages in parts of 256 tokens, each part an
    # item, the parts' sums merged after (page_sweep.h's Items); the shorter one's last
    # parts empty; a head size with no specialised build
    (3, [2100], 16, 64, torch.float32),
    (3, [700, 300], 16, 64, torch.float32),
    (4, [1000], 32, 128, torch.float32),
    (2, [600, 5], 16, 96, torch.float32),
    (3, [530, 257], 16, 64, torch.float16),
    # a KV head's query heads over a page at once (page_group.h), in blocks of at most 4:
    # 3 + 2, 4 + 3 (pages of 32, part-filled), 4 + 4 over converted fp16 pages, 3 + 3 split
    (5, [37, 100], 16, 64, torch.float32),
    (7, [19, 64, 5], 32, 128, torch.float32),
    (8, [33, 2], 16, 64, torch.float16),
    (6, [300], 16, 64, torch.float32),
]


@needs_op
@pytest.mark.parametrize("group,seq_lens,block_size,head_dim,dtype", CASES)
def test_cpu_decode_matches_reference(group, seq_lens, block_size, head_dim, dtype):
    kv_heads = 2
    pool = sum(-(-n // block_size) for n in seq_lens) + 5
    k_cache, v_cache = make_cache(pool, block_size, kv_heads, head_dim, dtype, "cpu", 3)
    tables = scattered_tables(seq_lens, block_size, pool, 3)
    poison_tails(k_cache, v_cache, tables, seq_lens, block_size)  # NaN past every end
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn(len(seq_lens), kv_heads * group, head_dim).to(dtype)
    expected = reference.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1)
    actual = op(q, k_cache, v_cache, tables, lens, 0.1)
    assert actual.shape == q.shape and actual.dtype == dtype
    close(actual, expected, dtype)


@needs_op
@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("group,block_size,head_dim", [(3, 16, 64), (4, 32, 128), (2, 16, 96),
                                                     (4, 16, 256)])
@pytest.mark.parametrize("seq_lens", [
    [3, 47, 160, 16, 90] * 4,  # 20 sequences: whole-sequence items
    [2100, 5, 1500, 700] * 3,  # longer than one sweep (512 KB of K + V) of a whole sequence
    [2100],  # one sequence: its pages in parts of 256 tokens (streaming), merged after
    [700, 300],  # two: split by the longer, the shorter's last part empty
], ids=["short", "long", "one-long", "two-split"])
def test_cpu_decode_bf16_is_one_rounding_from_exact(group, block_size, head_dim, seq_lens,
                                                     cached):
    """bf16 caches: the op computes in fp32 (on the raw bf16 where the CPU has AVX512-BF16),
    so each output is the float64 attention of the same bf16 inputs rounded once to bf16,
    in either schedule of the AVX512-BF16 kernel (`cached`: the one prefill rows take; the
    streaming one reads the pages in sweeps of kSweepBytes, paged_decode_bf16.h)."""
    kv_heads = 3
    pool = sum(-(-n // block_size) for n in seq_lens) + 5
    k_cache, v_cache = make_cache(pool, block_size, kv_heads, head_dim, torch.bfloat16, "cpu", 5)
    tables = scattered_tables(seq_lens, block_size, pool, 5)
    poison_tails(k_cache, v_cache, tables, seq_lens, block_size)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q = (torch.randn(len(seq_lens), kv_heads * group, head_dim) * 2).bfloat16()
    exact = reference.paged_decode_attention(q.double(), k_cache.double(), v_cache.double(),
                                             tables, lens, head_dim ** -0.5)
    actual = op(q, k_cache, v_cache, tables, lens, head_dim ** -0.5, cached=cached).double()
    assert ((actual - exact).abs() <= exact.abs() * 2 ** -8 + 1e-5).all()




@needs_op
@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("batch", [1, 2, 20])
@pytest.mark.parametrize("group,head_dim", [(3, 64), (4, 128)])
def test_cpu_decode_bf16_rescales_when_the_max_jumps(batch, group, head_dim, cached):
    """The bf16 kernel keeps a reference max that moves only when a score passes it by more
    than its slack (8): keys that line up with q more and more, 9 to 11 higher every 16
    tokens, move it on every group of 16 (and overflow fp32 if it never moved). Batch 1 and 2
    are one work item per KV head, so in the cached schedule the pending group's weights
    share the state that is rescaled; at 20 an item is a whole sequence. Each output one
    bf16 rounding from exact."""
    block_size, kv_heads, n = 16, 3, 150
    generator = torch.Generator().manual_seed(7)
    q = (torch.randn(batch, kv_heads * group, head_dim, generator=generator) * 2).bfloat16()
    scale = head_dim ** -0.5
    # key t of a KV head: its first query head's direction times a level that climbs ~10 a
    # group of 16 tokens (in score units), plus noise
    direction = q.float().view(batch, kv_heads, group, head_dim)[:, :, 0]
    direction = direction / (direction.norm(dim=-1, keepdim=True) ** 2 * scale)
    steps = 9 + 2 * torch.rand(batch, n // 16 + 1, generator=generator)
    level = steps.cumsum(1).repeat_interleave(16, 1)[:, :n]  # [batch, n]
    keys = level[:, :, None, None] * direction[:, None] + torch.randn(
        batch, n, kv_heads, head_dim, generator=generator) * 0.1
    pages = -(-n // block_size)
    tables = torch.randperm(batch * pages, generator=generator).int().view(batch, pages)
    k_cache = torch.zeros(batch * pages, block_size, kv_heads, head_dim, dtype=torch.bfloat16)
    v_cache = torch.randn(batch * pages, block_size, kv_heads, head_dim,
                          generator=generator).bfloat16()
    for b in range(batch):
        k_cache[tables[b]] = torch.nn.functional.pad(
            keys[b], (0, 0, 0, 0, 0, pages * block_size - n)).view(
            pages, block_size, kv_heads, head_dim).bfloat16()
    lens = torch.full((batch,), n, dtype=torch.int32)
    exact = reference.paged_decode_attention(q.double(), k_cache.double(), v_cache.double(),
                                             tables, lens, scale)
    actual = op(q, k_cache, v_cache, tables, lens, scale, cached=cached).double()
    assert torch.isfinite(actual).all()
    assert ((actual - exact).abs() <= exact.abs() * 2 ** -8 + 1e-5).all()


@needs_op
@pytest.mark.parametrize("group,shapes,block_size,head_dim,dtype", PREFILL_CASES)
@pytest.mark.parametrize("as_decode", [True, False])
def test_cpu_prefill_matches_reference(group, shapes, block_size, head_dim, dtype, as_decode,
                                       monkeypatch):
    """CpuAttention.prefill: chunks up to PREFILL_AS_DECODE_MAX rows run as
    decode rows of the C++ op (row i of a chunk over its first seq_len - q_len + i + 1
    tokens: cached prefixes and earlier chunks included), longer ones through SDPA."""
    import tritonserve.engine.attention as attention

    if not as_decode:
        monkeypatch.setattr(attention, "PREFILL_AS_DECODE_MAX", 0)
    else:  # the rows whatever the context (long fp32 / bf16 ones take SDPA by default)
        monkeypatch.setattr(attention, "PREFILL_SDPA_CONTEXT", 1 << 30)
    kv_heads = 2
    seq_lens = [s for _, s in shapes]
    pool = sum(-(-n // block_size) for n in seq_lens) + 7
    k_cache, v_cache = make_cache(pool, block_size, kv_heads, head_dim, dtype, "cpu", 6)
    tables = scattered_tables(seq_lens, block_size, pool, 6)
    poison_tails(k_cache, v_cache, tables, seq_lens, block_size)
    q_lens = [q for q, _ in shapes]
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn(int(cu[-1]), kv_heads * group, head_dim).to(dtype)
    expected = reference.paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, 0.125)
    actual = CpuAttention().prefill(q, k_cache, v_cache, tables, cu, lens,
                                                         max(q_lens), 0.125)
    close(actual, expected, dtype)


@needs_op
@pytest.mark.parametrize("dtype, lens, rows", [
    (torch.float32, [300, 260], False),  # long fp32 contexts: SDPA's GEMMs
    (torch.float32, [64] * 8, True),  # short sequences: the rows (SDPA loops per sequence)
    (torch.bfloat16, [300, 260], False),  # long bf16 contexts: SDPA's bf16 kernels
    (torch.bfloat16, [64] * 8, True),
    (torch.float16, [300, 260], True),  # fp16 keeps the rows
])
def test_cpu_prefill_picks_sdpa_for_long_contexts(dtype, lens, rows, monkeypatch):
    from tritonserve.engine import attention
    chose = []
    monkeypatch.setattr(attention.TorchAttention, "prefill",
                        lambda self, *args: chose.append("sdpa"))
    backend = CpuAttention()
    real = backend.cpu_decode
    backend.cpu_decode = lambda *args, **kw: chose.append("rows") or real(*args, **kw)
    k_cache, v_cache = make_cache(sum(-(-n // 16) for n in lens) + 2, 16, 2, 64, dtype, "cpu", 1)
    tables = scattered_tables(lens, 16, k_cache.shape[0], 1)
    cu = torch.tensor([0] + [16 * (i + 1) for i in range(len(lens))], dtype=torch.int32)
    q = torch.randn(16 * len(lens), 4, 64).to(dtype)
    backend.prefill(q, k_cache, v_cache, tables, cu, torch.tensor(lens, dtype=torch.int32), 16,
                    0.125)
    assert chose == ["rows" if rows else "sdpa"]


@needs_op
@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_decode_work_split_does_not_change_the_result(threads):
    """The op splits a sequence into per-KV-head items below 4 x threads sequences and keeps
    it whole above: with 1 thread 6 sequences run whole, with 2 they split; both match."""
    seq_lens, block_size, kv_heads, group, head_dim = [5, 200, 64, 70, 17, 33], 16, 3, 3, 64
    pool = sum(-(-n // block_size) for n in seq_lens) + 5
    k_cache, v_cache = make_cache(pool, block_size, kv_heads, head_dim, torch.float32, "cpu", 4)
    tables = scattered_tables(seq_lens, block_size, pool, 4)
    poison_tails(k_cache, v_cache, tables, seq_lens, block_size)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn(len(seq_lens), kv_heads * group, head_dim)
    expected = reference.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        actual = op(q, k_cache, v_cache, tables, lens, 0.1)
    finally:
        torch.set_num_threads(before)
    close(actual, expected, torch.float32)


@needs_op
@pytest.mark.parametrize("seq_lens", [[1000], [700, 300], [257]])
def test_cpu_decode_split_sequences_do_not_depend_on_the_thread_count(seq_lens):
    """bf16 at batch <= 2: the parts a sequence's pages split into follow its length alone,
    so 1, 2 or 3 threads give the same bits."""
    block_size, kv_heads, group, head_dim = 16, 3, 3, 64
    pool = sum(-(-n // block_size) for n in seq_lens) + 5
    k_cache, v_cache = make_cache(pool, block_size, kv_heads, head_dim, torch.bfloat16, "cpu", 6)
    tables = scattered_tables(seq_lens, block_size, pool, 6)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn(len(seq_lens), kv_heads * group, head_dim).bfloat16()
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(op(q, k_cache, v_cache, tables, lens, 0.125))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@needs_op
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_decode_reads_a_strided_query(dtype):
    """q as the engine passes it: a view into the fused qkv output (head stride != head_dim
    * heads), which the op must read through its strides."""
    k_cache, v_cache = make_cache(8, 16, 2, 64, dtype, "cpu", 4)
    tables = torch.tensor([[3, 5], [1, 0]], dtype=torch.int32)
    lens = torch.tensor([20, 9], dtype=torch.int32)
    qkv = torch.randn(2, 8 * 64 + 2 * 2 * 64).to(dtype)
    q = qkv[:, :8 * 64].view(2, 8, 64)
    assert not q.is_contiguous()
    close(op(q, k_cache, v_cache, tables, lens, 0.125),
          reference.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125), dtype)


def test_backend_falls_back_to_torch_without_the_op(monkeypatch):
    """TRITONSERVE_CPU_OPS=0 (or no toolchain): the backend serves decode with plain torch,
    and both paths give the same attention."""
    monkeypatch.setenv("TRITONSERVE_CPU_OPS", "0")
    assert cpu.load.__wrapped__() is False
    k_cache, v_cache = make_cache(12, 16, 2, 64, torch.float32, "cpu", 5)
    tables = scattered_tables([30, 70], 16, 12, 5)
    lens = torch.tensor([30, 70], dtype=torch.int32)
    q = torch.randn(2, 4, 64)
    fallback = CpuAttention()
    fallback.cpu_decode = None
    expected = reference.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
    close(fallback.decode(q, k_cache, v_cache, tables, lens, 70, 0.125), expected, torch.float32)
    if op is not None:
        assert CpuAttention().cpu_decode is not None


def test_sources_are_staged_once_at_stable_paths(tmp_path):
    """The build reads copies under the cache, rewritten only when a source changes, so every
    checkout of the same code names the same paths and reuses one build."""
    first = cpu_build.stage_sources(tmp_path)
    assert [p.rsplit("/", 1)[1] for p in first] == [s.name for s in cpu_build.SOURCES]
    for header in cpu_build.HEADERS:  # beside the sources, where their #include finds it
        assert (Path(first[0]).parent / header.name).read_bytes() == header.read_bytes()
    stamps = [Path(p).stat().st_mtime_ns for p in first]
    Path(first[0]).write_text("// edited\n")
    again = cpu_build.stage_sources(tmp_path)
    assert again == first
    assert Path(first[0]).read_bytes() == cpu_build.SOURCES[0].read_bytes()  # restored
    assert Path(first[1]).stat().st_mtime_ns == stamps[1]  # untouched: same contents


@needs_op
@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_cpu_decode_bench_runs(capsys, kv):
    """`tritonserve bench cpu-decode` on tiny shapes: a row per batch, the op (both schedules)
    and torch timed, over an fp32 cache or an int8 one."""
    from tritonserve.bench import cpu_decode
    assert cpu_decode.main(["--batches", "1,3", "--input-range", "5:40", "--calls", "2",
                            "--flush-mb", "1", "--pool-mb", "1", "--heads", "4",
                            "--kv-heads", "2", "--head-dim", "64", "--kv-dtype", kv,
                            "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert f"KV cache {'int8' if kv == 'int8' else 'float32'}" in out.splitlines()[0]
    rows = [line.split() for line in out.splitlines()[2:]]
    assert [int(r[0]) for r in rows] == [1, 3]
    assert all(float(r[2]) > 0 and float(r[4]) > 0 and float(r[6]) > 0 and float(r[7]) > 0
               and float(r[8]) > 0 for r in rows)


def test_cpu_decode_bench_engine_layout():
    """--layout engine: every page gets its own block, prompt pages per sequence in turn,
    then the later pages interleaved across the sequences."""
    from tritonserve.bench.cpu_decode import engine_tables
    tables = engine_tables([3, 5, 6], 2, 40, torch.Generator().manual_seed(0))
    base = int(tables[0, 0])
    assert (tables[:, :2] - base).tolist() == [[0, 1], [2, 3], [4, 5]]
    assert (tables[1:, 2] - base).tolist() == [7, 8] and int(tables[0, 2]) - base == 6
    assert (tables[1:, 3] - base).tolist() == [9, 10] and int(tables[2, 5]) - base == 13
    used = [int(tables[r, p]) for r, n in enumerate([3, 5, 6]) for p in range(n)]
    assert sorted(used) == list(range(base, base + 14)) and base + 14 <= 40


def test_cpu_linear_bench_runs(capsys):
    """`tritonserve bench cpu-linear` on tiny shapes: a row per M with every available form timed
    (the C++ panels here, oneDNN where it is built in, and the quantized forms: q4 to q8)."""
    from tritonserve.bench import cpu_linear
    assert cpu_linear.main(["--rows", "1,3", "--layers", "1", "--hidden", "32",
                            "--intermediate", "64", "--heads", "2", "--kv-heads", "1",
                            "--head-dim", "16", "--vocab", "100", "--repeats", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if line.startswith("M=")]
    assert [r.split(":")[0] for r in rows] == ["M=1", "M=3"]
    assert all("panels (C++)" in r and "GFLOP/s" in r for r in rows)
    assert all(f in r for r in rows for f in ("q4 (u4", "q8 (s8)", "q6 (s8h", "q5 (s8hm"))


def _op_cases():
    """(name, op, args) for every C++ op, with small inputs in each dtype it serves."""
    gen = torch.Generator().manual_seed(8)
    k_cache, v_cache = make_cache(6, 16, 2, 64, torch.float32, "cpu", 8)
    tables = torch.tensor([[3, 1], [0, 5]], dtype=torch.int32)
    lens = torch.tensor([20, 9], dtype=torch.int32)
    q = torch.randn(2, 6, 64, generator=gen)
    add_rms_norm, silu_and_mul = (cpu.op("add_rms_norm"), cpu.op("silu_and_mul"))
    pack, product = cpu.panel_ops(torch.float32)
    pack16, product16 = cpu.panel_ops(torch.bfloat16)
    pack_gate_up, silu_product16 = (cpu.pack_gate_up_bf16, cpu.op("packed_linear_silu_mul_bf16"))
    x, w = torch.randn(5, 40, generator=gen), torch.randn(70, 40, generator=gen)
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        cases.append((f"paged_decode_attention {dtype}", op,
                      (q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), tables, lens, 0.125)))
        cases.append((f"add_rms_norm {dtype}", add_rms_norm,
                      (x.to(dtype), torch.randn(5, 40, generator=gen).to(dtype),
                       torch.rand(40, generator=gen).to(dtype), 1e-5)))
        cases.append((f"silu_and_mul {dtype}", silu_and_mul, (x.to(dtype),)))
        cases.append((f"rotary_embedding {dtype}", cpu.op("rotary_embedding"),
                      (q.to(dtype)[:, :, :32], torch.randn(2, 1, 32, generator=gen).to(dtype),
                       torch.randn(2, 1, 32, generator=gen).to(dtype))))
    kc, vc = k_cache.bfloat16(), v_cache.bfloat16()
    cases.append(("rope_store_kv", cpu.op("rope_store_kv"),
                  (torch.randn(3, 10 * 64, generator=gen).bfloat16(),
                   torch.randn(3, 1, 64, generator=gen).bfloat16(),
                   torch.randn(3, 1, 64, generator=gen).bfloat16(), torch.tensor([4, -1, 40]),
                   kc, vc, 6)))
    cases += [
        ("packed_linear", product, (x, pack(w), 70, torch.randn(70, generator=gen))),
        ("packed_linear_bf16", product16, (x.bfloat16(), pack16(w.bfloat16()), 70, None)),
        ("packed_linear_silu_mul_bf16", silu_product16,
         (x.bfloat16(), pack_gate_up(torch.randn(64, 40, generator=gen).bfloat16()))),
        ("sample_softmax", cpu.op("sample_softmax"),
         (torch.randn(3, 100, generator=gen), torch.ones(3), torch.arange(3))),
    ]
    return cases


@needs_op
def test_fake_implementations_agree_with_the_ops():
    """torch.compile traces each op through its fake implementation, and the compiled step
    runs without Inductor's size asserts (engine/decode_graphs.py): what the fake says about
    an output's shape, strides and dtype must be what the op returns, and the schemas must
    declare what the ops mutate."""
    for name, fn, args in _op_cases():
        try:
            torch.library.opcheck(fn, args, test_utils=("test_schema", "test_faketensor"))
        except Exception as exc:
            raise AssertionError(f"{name}: {exc}") from exc


@needs_op
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rotary_embedding_rounds_the_exact_rotation_once(dtype):
    """The C++ rope reads q / k as the views of the qkv output they are (row stride != heads
    x D) and returns x * cos + rotate_half(x) * sin computed in fp32 and rounded once: within
    one rounding step of the float64 rotation of the same inputs."""
    from tritonserve.engine.models.decoder import RotaryEmbedding
    rotate = cpu.op("rotary_embedding")
    gen = torch.Generator().manual_seed(11)
    qkv = torch.randn(37, 9 * 64 + 2 * 3 * 64, generator=gen).to(dtype)
    q = qkv[:, :9 * 64].view(37, 9, 64)
    angles = torch.rand(37, 1, 64, generator=gen) * 6.3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    out = rotate(q, cos, sin)
    assert out.shape == q.shape and out.is_contiguous() and out.dtype == dtype
    qd, cd, sd = q.double(), cos.double(), sin.double()
    exact = qd * cd + torch.cat((-qd[..., 32:], qd[..., :32]), dim=-1) * sd
    ulp = exact.abs().clamp_min(1e-30).log2().floor().exp2() * torch.finfo(dtype).eps
    assert ((out.double() - exact).abs() <= ulp + 1e-6).all()
    # the same within a few steps of eager torch's op-by-op roundings (what fp32 still runs)
    plain = q * cos + torch.cat((-q[..., 32:], q[..., :32]), dim=-1) * sin
    assert (out.double() - plain.double()).abs().max() <= 4 * ulp.max()
    if dtype != torch.float32:  # what the decoder takes for its eager CPU rope
        assert torch.equal(RotaryEmbedding.apply(q, (cos, sin)), out)


@needs_op
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rope_store_kv_rotates_and_writes_what_the_unfused_path_does(dtype):
    """The fused op on a qkv projection output (with a row stride past its width, as a
    slice gives): q as rotary_embedding returns it, the rotated k and the v written at their
    slots (slot -1 skipped) and every other slot untouched; a slot out of range raises before
    anything is written."""
    rope_store, rotate = cpu.op("rope_store_kv"), cpu.op("rotary_embedding")
    gen = torch.Generator().manual_seed(12)
    heads, kv_heads, dim, rows = 6, 2, 64, 9
    wide = torch.randn(rows, (heads + 2 * kv_heads) * dim + 8, generator=gen).to(dtype)
    qkv = wide[:, :(heads + 2 * kv_heads) * dim]
    angles = torch.rand(rows, 1, dim, generator=gen) * 6.3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    k_cache = torch.randn(5, 4, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(5, 4, kv_heads, dim, generator=gen).to(dtype)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([0, 7, -1, 19, 3, 12, 8, -1, 5])
    q = rope_store(qkv, cos, sin, slots, k_cache, v_cache, heads)
    q_in, k_in, v_in = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    assert q.shape == (rows, heads, dim) and q.is_contiguous()
    assert torch.equal(q, rotate(q_in.view(rows, heads, dim), cos, sin))
    k_rot = rotate(k_in.view(rows, kv_heads, dim), cos, sin)
    expect_k, expect_v = before_k.view(-1, kv_heads, dim), before_v.view(-1, kv_heads, dim)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expect_k[slot], expect_v[slot] = k_rot[t], v_in[t].view(kv_heads, dim)
    assert torch.equal(k_cache.view(-1, kv_heads, dim), expect_k)
    assert torch.equal(v_cache.view(-1, kv_heads, dim), expect_v)
    written = k_cache.clone()
    with pytest.raises(RuntimeError, match="slot 20 out of range"):
        rope_store(qkv, cos, sin, torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 20]), k_cache, v_cache,
                   heads)
    assert torch.equal(k_cache, written)
    with pytest.raises(RuntimeError, match="num_heads"):
        rope_store(qkv, cos, sin, slots, k_cache, v_cache, heads + 1)


@needs_op
def test_cpu_bf16_attention_uses_the_fused_rope_store(tiny_model):
    """bf16 on the CPU: the model hands the qkv output to the backend's fused rope + store
    (eager prefill and the compiled decode alike); fp32 keeps torch's op-by-op rope."""
    from tritonserve.engine import LLM, SamplingParams
    calls = []
    fused = torch.ops.tritonserve.rope_store_kv
    backend = CpuAttention()
    bf16, fp32, int8 = (torch.empty(1, 8, dtype=d) for d in (torch.bfloat16, torch.float32,
                                                              torch.int8))
    assert backend.rope_store(bf16, bf16) is fused
    assert backend.rope_store(fp32, fp32) is None
    assert backend.rope_store(bf16, int8) is None  # an int8 cache: reference.quantize_kv
    llm = LLM(tiny_model, dtype="bfloat16", max_num_seqs=2, decode_mode="eager")
    runner_backend = llm.engine.runner.backend
    runner_backend.cpu_rope_store = lambda *args: calls.append(args[0].shape) or fused(*args)
    out = llm.generate(["a b c d"], SamplingParams(temperature=0.0, max_tokens=3))[0]
    layers = llm.engine.arch.num_layers
    assert len(calls) == 3 * layers  # the prefill, then two decode steps
    assert len(out.token_ids) == 3


@needs_op
def test_core_to_core_probe_times_a_line_between_two_threads():
    """machine_probe.cpp: a positive, finite trip with two threads (bench/machine.sh prints
    it beside the read rate), NaN with one, and trips below 1 refused naming the argument."""
    probe = cpu.op("core_to_core_ns")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        ns = probe(2000)
        assert 0 < ns < 1e6
        torch.set_num_threads(1)
        assert probe(10) != probe(10)  # NaN
    finally:
        torch.set_num_threads(before)
    with pytest.raises(RuntimeError, match="trips"):
        probe(0)
