"""Weight-only quantized matmuls: the packed layout (kernels/quant_layout.py) against its
oracle, GGUF block parsing (engine/models/gguf.py) against the `gguf` package's own
dequantizers, and the C++ op (kernels/cpu/linear_quant.cpp) against the plain-torch
reference, in fp32 and bf16, every row-tile size, a partial last panel and a bias."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from tritonserve.engine.models import gguf as gguf_weights
from tritonserve.kernels import cpu, quant_layout

needs_library = pytest.mark.skipif(cpu.op("packed_linear_quant") is None,
                                   reason="no C++ toolchain")


KINDS = ["u4", "s8", "s8h", "s8hm"]


def _random(kind: str, n: int, k: int, seed: int = 0) -> dict:
    """pack's arguments for a kind: d and q, u4's and s8hm's offsets m, s8h's and s8hm's int8
    half-group scales sub."""
    g = torch.Generator().manual_seed(seed)
    d = torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3
    if kind == "u4":
        return dict(d=d, q=torch.randint(0, 16, (n, k), generator=g),
                    m=-torch.rand(n, k // 32, generator=g) * 0.1)
    parts = dict(d=d, q=torch.randint(-128, 128, (n, k), generator=g))
    if kind in ("s8h", "s8hm"):  # K types' scales are small: d / 64 keeps products in range
        parts.update(d=d / 64, sub=torch.randint(-128, 128, (n, k // 16), generator=g))
    if kind == "s8hm":
        parts["m"] = torch.randn(n, k // 32, generator=g) * 0.1
    return parts


def _pack(kind: str, parts: dict) -> torch.Tensor:
    return quant_layout.pack(kind, parts["d"], parts["q"], parts.get("m"), sub=parts.get("sub"))


@pytest.mark.parametrize("kind", KINDS)
def test_pack_and_unpack_are_inverse_and_dequantize_is_d_q_plus_m(kind):
    n, k = 37, 96  # a partial last panel (37 = 2 x 16 + 5)
    parts = _random(kind, n, k)
    d, q, m, sub = (parts.get(key) for key in ("d", "q", "m", "sub"))
    packed = _pack(kind, parts)
    assert packed.shape == (3, 3, quant_layout.RECORD_BYTES[kind])
    assert quant_layout.kind_of(packed) == kind
    d2, q2, m2 = quant_layout.unpack(packed, n)
    assert torch.equal(q2.long(), q.long())
    scale = d.half().float()
    offset = torch.zeros_like(scale) if m is None else m.half().float()
    if sub is not None:  # a scale each 16 k: d * s, exact in fp32
        scale = scale.repeat_interleave(2, dim=1) * sub.float()
        offset = offset.repeat_interleave(2, dim=1)
    assert torch.equal(d2, scale) and torch.equal(m2, offset)
    width = k // scale.shape[1]
    expected = (q.float() * scale.repeat_interleave(width, dim=1)
                + offset.repeat_interleave(width, dim=1))
    assert torch.equal(quant_layout.dequantize(packed, n), expected)
    # every kind goes into s8hm as it is (a fused projection's parts in different kinds)
    assert torch.equal(quant_layout.dequantize(quant_layout.as_s8hm(packed, n), n),
                       expected)
    # the reference runs where the weight lies (the CUDA engine's reference path; an H200
    # run found it building its shifts on the CPU): on "meta" any CPU operand would raise
    d3, q3, m3 = quant_layout.unpack(packed.to("meta"), n)
    assert (d3.device.type, q3.shape, m3.shape) == ("meta", q.shape, scale.shape)


def test_pack_refuses_codes_out_of_range_and_ragged_rows():
    d = torch.ones(2, 1)
    with pytest.raises(ValueError, match=r"u4 codes must lie in \[0, 15\]"):
        quant_layout.pack("u4", d, torch.full((2, 32), 16))
    with pytest.raises(ValueError, match="multiple of 32"):
        quant_layout.pack("s8", torch.ones(2, 1), torch.zeros(2, 33, dtype=torch.int16))
    with pytest.raises(ValueError, match="kind must be one of"):
        quant_layout.pack("u3", d, torch.zeros(2, 32))
    with pytest.raises(ValueError, match="row length 40"):
        quant_layout.quantize(torch.randn(4, 40), "u4")
    codes = torch.zeros(2, 32, dtype=torch.int16)
    with pytest.raises(ValueError, match="they need it"):
        quant_layout.pack("s8h", d, codes)
    with pytest.raises(ValueError, match="they need it"):
        quant_layout.pack("s8", d, codes, sub=torch.zeros(2, 2))
    with pytest.raises(ValueError, match="m .* is u4's and s8hm's, not s8h's"):
        quant_layout.pack("s8h", d, codes, torch.zeros(2, 1), sub=torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"sub must be int8 values \[N, K / 16\]"):
        quant_layout.pack("s8h", d, codes, sub=torch.zeros(2, 1))
    with pytest.raises(ValueError, match="sub must be int8"):
        quant_layout.pack("s8h", d, codes, sub=torch.full((2, 2), 128))


@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1"])
def test_gguf_blocks_parse_to_what_the_gguf_package_dequantizes(ggml_type):
    """The oracle: gguf.quants quantizes a random matrix into the type's blocks and
    dequantizes them; our parse + pack + dequantize gives the same fp32 weights exactly."""
    quants = pytest.importorskip("gguf.quants")
    import gguf
    qtype = getattr(gguf.GGMLQuantizationType, ggml_type)
    weights = np.random.default_rng(1).standard_normal((40, 128)).astype(np.float32)
    raw = quants.quantize(weights, qtype)
    oracle = torch.from_numpy(quants.dequantize(raw, qtype))
    packed = gguf_weights.pack_parsed(ggml_type,
                                      gguf_weights.parse_blocks(ggml_type, raw, 40, 128))
    assert quant_layout.kind_of(packed) == gguf_weights.SERVED[ggml_type][0]
    assert torch.equal(quant_layout.dequantize(packed, 40), oracle)


def _q4_k_blocks(n: int, supers: int, seed: int = 0) -> np.ndarray:
    """Random Q4_K rows (gguf-py has no Q4_K quantizer): fp16 d and dmin of a weight's size,
    every scale/min/code byte random (each of the 6-bit scale packings is exercised)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, supers, 144), dtype=np.uint8)
    raw[:, :, 0:4] = (rng.random((n, supers, 2)) * 1e-3 + 1e-4).astype(np.float16).view(
        np.uint8).reshape(n, supers, 4)
    return raw.reshape(n, supers * 144)


def test_q4_k_blocks_parse_to_the_gguf_dequantizer_within_the_fp16_scale():
    """Q4_K: eight 32-wide groups a super block, codes as they are; each group's d * scale
    and dmin * min kept in fp16 (the layout's): within 2^-11 of each group's scale."""
    quants = pytest.importorskip("gguf.quants")
    import gguf
    n, k = 24, 512
    raw = _q4_k_blocks(n, k // 256)
    oracle = torch.from_numpy(quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K))
    d, q, m = gguf_weights.parse_blocks("Q4_K", raw, n, k)
    assert q.shape == (n, k) and int(q.min()) >= 0 and int(q.max()) <= 15
    # exact before the fp16 rounding: the parse is the dequantizer's arithmetic
    exact = q.float() * d.repeat_interleave(32, dim=1) + m.repeat_interleave(32, dim=1)
    torch.testing.assert_close(exact, oracle, rtol=1e-6, atol=1e-9)
    got = quant_layout.dequantize(quant_layout.pack("u4", d, q, m), n)
    bound = (15 * d.abs() + m.abs()).repeat_interleave(32, dim=1) * 2.0 ** -11
    assert bool(((got - oracle).abs() <= bound + 1e-12).all())


def _q6_k_blocks(n: int, supers: int, seed: int = 0) -> np.ndarray:
    """Random Q6_K rows (gguf-py has no Q6_K quantizer): every code, high-bit and scale byte
    random, fp16 d of a weight's size."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, supers, 210), dtype=np.uint8)
    raw[:, :, 208:] = (rng.random((n, supers, 1)) * 1e-3 + 1e-5).astype(np.float16).view(
        np.uint8)
    return raw.reshape(n, supers * 210)


def test_q6_k_blocks_parse_to_exactly_what_the_gguf_package_dequantizes():
    """Q6_K: 6-bit codes less 32 as int8, each 16-wide sub block's int8 scale kept beside the
    super block's d (s8h): the packed weight dequantizes to gguf's own fp32 weights, bit for
    bit (d * s is exact in fp32, as gguf forms it)."""
    quants = pytest.importorskip("gguf.quants")
    import gguf
    n, k = 40, 768  # a partial last panel, three super blocks
    raw = _q6_k_blocks(n, k // 256)
    oracle = torch.from_numpy(quants.dequantize(raw, gguf.GGMLQuantizationType.Q6_K))
    d, q, sub = gguf_weights.parse_blocks("Q6_K", raw, n, k)
    assert q.shape == (n, k) and int(q.min()) == -32 and int(q.max()) == 31
    assert sub.shape == (n, k // 16)
    packed = gguf_weights.pack_parsed("Q6_K", (d, q, sub))
    assert quant_layout.kind_of(packed) == "s8h"
    assert torch.equal(quant_layout.dequantize(packed, n), oracle)


def test_q5_k_blocks_parse_to_the_gguf_dequantizer_within_the_fp16_offset():
    """Q5_K: Q4_K's scales and mins with a fifth bit a code, as s8hm: d and each sub block's
    6-bit scale kept apart (their product exact), the offset -dmin * min rounded to fp16:
    within 2^-11 of each group's offset of gguf's weights, and exact before that rounding."""
    quants = pytest.importorskip("gguf.quants")
    import gguf
    n, k = 24, 512
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, (n, k // 256, 176), dtype=np.uint8)
    raw[:, :, 0:4] = (rng.random((n, k // 256, 2)) * 1e-3 + 1e-4).astype(np.float16).view(
        np.uint8).reshape(n, k // 256, 4)
    raw = raw.reshape(n, -1)
    oracle = torch.from_numpy(quants.dequantize(raw, gguf.GGMLQuantizationType.Q5_K))
    d, q, m, sub = gguf_weights.parse_blocks("Q5_K", raw, n, k)
    assert int(q.min()) == 0 and int(q.max()) == 31 and sub.shape == (n, k // 16)
    scale = (d.repeat_interleave(2, dim=1) * sub.float()).repeat_interleave(16, dim=1)
    exact = q.float() * scale + m.repeat_interleave(32, dim=1)
    assert torch.equal(exact, oracle)
    got = quant_layout.dequantize(gguf_weights.pack_parsed("Q5_K", (d, q, m, sub)), n)
    bound = m.abs().repeat_interleave(32, dim=1) * 2.0 ** -11
    assert bool(((got - oracle).abs() <= bound + 1e-12).all())


def _write_gguf(path, tensors: dict):
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (raw, ggml_type) in tensors.items():
        writer.add_tensor(name, raw, raw_shape=raw.shape,
                          raw_dtype=getattr(gguf.GGMLQuantizationType, ggml_type))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_type_with_no_block_form_is_refused_when_asked_and_left_dense_under_auto(tmp_path):
    """Q2_K (2-bit codes under 4-bit scales) has no form in the layout: strict
    (--quantization gguf) names the tensor and type, lenient (auto) serves the Q4_K and Q6_K
    tensors as blocks and lists the Q2_K one as left dense; the kept panels remember which (a
    strict start on a kept file refuses too)."""
    path = _write_gguf(tmp_path / "k.gguf", {
        "blk.0.ffn_down.weight": (_q4_k_blocks(16, 1), "Q4_K"),
        "blk.0.ffn_gate.weight": (_q6_k_blocks(16, 1), "Q6_K"),
        "blk.0.ffn_up.weight": (np.zeros((4, 84), dtype=np.uint8), "Q2_K")})
    with pytest.raises(gguf_weights.GGUFError, match="blk.0.ffn_up.weight is Q2_K"):
        gguf_weights.read_quantized(path, 2, 1)
    served = gguf_weights.read_quantized(path, 2, 1, strict=False)
    assert list(served) == ["model.layers.0.mlp.down_proj.weight",
                            "model.layers.0.mlp.gate_proj.weight"]
    assert served["model.layers.0.mlp.down_proj.weight"].kind == "u4"
    assert served["model.layers.0.mlp.gate_proj.weight"].kind == "s8h"
    assert served.skipped == {"blk.0.ffn_up.weight": "Q2_K"}
    assert gguf_weights.types_of(served) == "Q4_K x1, Q6_K x1; dense (no block form): Q2_K x1"
    kept = gguf_weights.read_quantized_cached(path, 2, 1, tmp_path, strict=False)
    assert (tmp_path / gguf_weights.PACKED).exists() and kept.skipped == served.skipped
    again = gguf_weights.read_quantized_cached(path, 2, 1, tmp_path, strict=False)
    assert torch.equal(again["model.layers.0.mlp.down_proj.weight"].packed,
                       served["model.layers.0.mlp.down_proj.weight"].packed)
    assert again.skipped == served.skipped
    with pytest.raises(gguf_weights.GGUFError, match="blk.0.ffn_up.weight is Q2_K"):
        gguf_weights.read_quantized_cached(path, 2, 1, tmp_path, strict=True)


def test_fused_parts_in_different_kinds_are_repacked_into_s8hm_as_they_are():
    """q, k as u4 (Q4_K / Q4_1) and v as s8h (Q6_K): fuse_rows gives one s8hm weight whose
    rows dequantize to each part's own weights, bit for bit; parts of one kind keep it."""
    kinds = {"q": "u4", "k": "u4", "v": "s8h"}
    parts = [gguf_weights.QuantTensor("any", kind, _pack(kind, _random(kind, 32, 64, seed=i)),
                                      (32, 64)) for i, kind in enumerate(kinds.values())]
    fused = gguf_weights.fuse_rows(parts)
    assert quant_layout.kind_of(fused) == "s8hm"
    assert torch.equal(quant_layout.dequantize(fused, 96), torch.cat(
        [quant_layout.dequantize(p.packed, 32) for p in parts]))
    same = gguf_weights.fuse_rows(parts[:2])
    assert quant_layout.kind_of(same) == "u4" and torch.equal(
        same, torch.cat([p.packed for p in parts[:2]]))
    assert gguf_weights.fuse_rows([gguf_weights.QuantTensor(
        "any", "u4", _pack("u4", _random("u4", 20, 64)), (20, 64)), parts[2]]) is None


def test_llama_cpp_q_k_row_order_is_undone():
    """unpermute_rows is transformers' reverse permutation: rows (h, i, 2) -> (h, 2, i)."""
    rows = torch.arange(2 * 8).reshape(16, 1)  # 2 heads of 8 rows
    out = gguf_weights.unpermute_rows(rows, 2).flatten().tolist()
    assert out == [0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15]


@needs_library
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_op_matches_the_reference(kind, dtype):
    """Rows 1-9 (every tile size, and one past a tile: the widened-panel path), 17 and 70;
    N = 50 (a partial last panel); K = 96 and 576; with and without a bias. fp32: within
    fp32 rounding of the reference; bf16: the reference's fp32 sums rounded to bf16, within
    one bf16 step."""
    op = torch.ops.tritonserve.packed_linear_quant
    for k in (96, 576):
        packed = _pack(kind, _random(kind, 50, k, seed=k))
        bias = torch.randn(50)
        for rows in (*range(1, 10), 17, 70):
            x = torch.randn(rows, k).to(dtype)
            for b in (None, bias):
                ref = quant_layout.linear(x.float(), packed, 50, b)
                out = op(x, packed, 50, b)
                assert out.dtype == dtype and out.shape == (rows, 50)
                scale = ref.abs().max().item()
                if dtype == torch.float32:
                    assert (out - ref).abs().max().item() <= 1e-5 * scale, (k, rows)
                else:
                    step = ref.abs().clamp_min(scale * 2 ** -8) * 2 ** -7
                    assert ((out.float() - ref).abs() <= step).all(), (k, rows)


@needs_library
@pytest.mark.parametrize("kind", KINDS)
def test_bf16_rows_up_to_four_do_not_depend_on_their_company(kind):
    """A row's bf16 result is bit-identical whether the call has 1, 2, 3 or 4 rows (the
    one-row path's sums): a speculating step's K + 1 rows then give one row's tokens."""
    op = torch.ops.tritonserve.packed_linear_quant
    for k in (96, 576):  # an odd and an even number of groups
        packed = _pack(kind, _random(kind, 50, k, seed=k + 1))
        bias = torch.randn(50)
        x = torch.randn(4, k).to(torch.bfloat16)
        alone = torch.cat([op(x[r:r + 1], packed, 50, bias) for r in range(4)])
        for rows in (2, 3, 4):
            assert torch.equal(op(x[:rows], packed, 50, bias), alone[:rows]), (k, rows)


@needs_library
def test_the_op_refuses_bad_operands_naming_them():
    op = torch.ops.tritonserve.packed_linear_quant
    packed = quant_layout.quantize(torch.randn(32, 64), "u4")
    with pytest.raises(RuntimeError, match="x has K = 32"):
        op(torch.randn(2, 32), packed, 32, None)
    with pytest.raises(RuntimeError, match="N does not match"):
        op(torch.randn(2, 64), packed, 40, None)
    with pytest.raises(RuntimeError, match="weight must be uint8"):
        op(torch.randn(2, 64), packed[:, :, :100].contiguous(), 32, None)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        op(torch.randn(2, 64).half(), packed, 32, None)


def test_quantize_is_close_and_its_codes_are_the_nearest():
    """int4 per group of 32 (scale and offset), int8 per row and 6-bit a 16 k (s8h): every
    weight within half a step (plus the offset's fp16 rounding) of the original."""
    w = torch.randn(48, 128)
    for kind in ("u4", "s8", "s8h"):  # s8hm: GGUF files and mixed parts only
        packed = quant_layout.quantize(w, kind)
        back = quant_layout.dequantize(packed, 48)
        d, _, _ = quant_layout.unpack(packed, 48)
        step = d.repeat_interleave(128 // d.shape[1], dim=1)
        assert ((back - w).abs() <= step * 0.5 + 2e-3).all(), kind
        assert ((back - w).abs() > step * 0.25).any(), kind  # it did round something


def test_packed_blocks_are_kept_beside_the_conversion(tmp_path, monkeypatch):
    """read_quantized_cached: the first call parses and keeps the packed panels in the folder
    (not as *.safetensors, which the loader would read as weights); the next maps them back
    without parsing; a changed file (mtime) is parsed again."""
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    rng = np.random.default_rng(0)
    for name, qtype in (("blk.0.ffn_down.weight", "Q4_1"), ("blk.0.ffn_up.weight", "Q8_0")):
        data = rng.standard_normal((32, 64)).astype(np.float32)
        qt = getattr(gguf.GGMLQuantizationType, qtype)
        raw = gguf.quants.quantize(data, qt)
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    folder = tmp_path / "converted"
    folder.mkdir()
    first = gguf_weights.read_quantized_cached(path, 2, 1, folder)
    assert [p.name for p in folder.iterdir()] == [gguf_weights.PACKED]
    parsed = []
    real = gguf_weights.read_quantized
    monkeypatch.setattr(gguf_weights, "read_quantized",
                        lambda *a: parsed.append(a) or real(*a))
    again = gguf_weights.read_quantized_cached(path, 2, 1, folder)
    assert parsed == [] and set(again) == set(first) == {"model.layers.0.mlp.down_proj.weight",
                                                         "model.layers.0.mlp.up_proj.weight"}
    for name, t in first.items():
        assert torch.equal(again[name].packed, t.packed)
        assert (again[name].type_name, again[name].kind, again[name].shape) == \
            (t.type_name, t.kind, t.shape)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    gguf_weights.read_quantized_cached(path, 2, 1, folder)
    assert len(parsed) == 1
