"""The quantized kinds, named once (kernels/quant_layout.py: KINDS): the table against the
bytes pack writes, against the C++ build's own table (panels_quant.h via quant_kinds()), the
Triton kernel's constexprs, and the GGUF types each kind serves."""
from __future__ import annotations

import pytest
import torch

from tritonserve.engine.models import gguf as gguf_weights
from tritonserve.kernels import cpu, quant_layout
from tritonserve.kernels.quant_layout import KINDS


def _codes(kind, n: int, k: int) -> dict:
    gen = torch.Generator().manual_seed(kind.id)
    lo, hi = (0, 16) if kind.code_bits == 4 else (-128, 128)
    parts = dict(d=torch.rand(n, k // 32, generator=gen) + 0.5,
                 q=torch.randint(lo, hi, (n, k), generator=gen))
    if kind.offset:
        parts["m"] = torch.rand(n, k // 32, generator=gen) - 0.5
    if kind.halves == 2:
        parts["sub"] = torch.randint(-128, 128, (n, k // 16), generator=gen)
    return parts


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_each_kind_is_the_bytes_pack_writes(kind):
    """A record is the kind's header (d, m, half-group scales) then its codes, 32 k of 16
    columns at code_bits each; the codes start at codes_at; kind_of names it back."""
    assert kind.record_bytes == kind.header_bytes + 32 * 16 * kind.code_bits // 8
    assert kind.codes_at == kind.header_bytes
    parts = _codes(kind, 16, 64)
    packed = quant_layout.pack(kind.name, **parts)
    assert packed.shape == (1, 2, kind.record_bytes)
    assert quant_layout.kind_of(packed) == kind.name
    if kind.code_bits == 8:  # the codes sit at codes_at, k-major, a column a byte
        codes = packed[0, 0, kind.codes_at:].view(torch.int8).reshape(32, 16)
        assert torch.equal(codes.t().to(torch.int64), parts["q"][:, :32])
    d, q, m, _ = quant_layout.factors(packed, 16)
    assert torch.equal(q.to(torch.int64), parts["q"])


def test_ids_and_names_are_unique_and_every_served_gguf_type_has_its_kind():
    assert [k.id for k in KINDS] == list(range(len(KINDS)))
    assert len({k.record_bytes for k in KINDS}) == len(KINDS)  # kind_of needs them apart
    for ggml_type, (kind, _, _) in gguf_weights.SERVED.items():
        assert ggml_type in quant_layout.BY_NAME[kind].gguf
    assert {t for k in KINDS for t in k.gguf} == set(gguf_weights.SERVED)


@pytest.mark.skipif(cpu.op("quant_kinds") is None, reason="no C++ toolchain")
def test_the_cpp_build_reads_each_kind_as_the_table_says():
    table = cpu.op("quant_kinds")().tolist()
    assert table == [[k.id, k.code_bits, k.record_bytes, k.codes_at, k.halves, int(k.offset)]
                     for k in KINDS]


def test_the_triton_kernel_takes_each_kind_from_the_table():
    pytest.importorskip("triton")
    from tritonserve.kernels.triton import quant_matmul
    assert quant_matmul.KINDS == {k.name: k.id for k in KINDS}
    for kind in KINDS:
        assert quant_matmul.kernel_args(kind.name) == dict(
            KIND=kind.id, RECORD=kind.record_bytes, CODES_AT=kind.codes_at)
