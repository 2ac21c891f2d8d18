"""engine/huge_pages.py: the weights a decode step streams gathered into one buffer advised
MADV_HUGEPAGE before its first touch; the engine's packed weights live there."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tritonserve.engine import LLM
from tritonserve.engine.huge_pages import ALIGN, HUGE_PAGE, gather, huge_page_bytes
from tritonserve.engine.models.linear import Linear, weight_form

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def test_gather_copies_into_one_aligned_buffer():
    tensors = [torch.randn(3, 5), torch.arange(7, dtype=torch.uint8),
               torch.randn(2, 4, 8).bfloat16(), torch.randn(1 << 20)]
    views = gather(tensors)
    assert gather([]) == []
    for t, v in zip(tensors, views):
        assert (v.dtype, v.shape) == (t.dtype, t.shape) and torch.equal(v, t)
        assert v.data_ptr() % ALIGN == 0
        assert v.untyped_storage().data_ptr() == views[0].untyped_storage().data_ptr()
    views[0].add_(1)  # copies, not the originals
    assert not torch.equal(views[0], tensors[0])


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(),
                    reason="transparent huge pages off here")
def test_the_buffer_is_on_huge_pages():
    (view,) = gather([torch.ones(8 << 20, dtype=torch.uint8)])
    assert huge_page_bytes(view.data_ptr()) >= 2 << 20


def test_the_engines_packed_weights_share_the_buffer(tiny_model):
    llm = LLM(tiny_model, dtype="float32", max_num_seqs=2)
    model = llm.engine.runner.model
    packed = [m.weight for m in model.modules()
              if isinstance(m, Linear) and weight_form(m.weight) == "panels"]
    assert len(packed) >= 4
    assert len({w.untyped_storage().data_ptr() for w in packed}) == 1


def test_an_adapters_packed_blob_is_gathered_too(tiny_model, tmp_path):
    """A decode step streams an adapter's whole packed blob beside the base weights
    (engine/lora.py): it lives in an arena of its own, on huge pages where THP is on."""
    pytest.importorskip("peft")
    from tests.test_lora import make_adapter
    adapter, _ = make_adapter(tiny_model, tmp_path, seed=1)
    llm = LLM(tiny_model, dtype="float32", max_num_seqs=2, lora_modules=(f"a0={adapter}",))
    engine = llm.engine
    blob, index = engine.loras["a0"].packed(engine.arch.num_layers)
    assert blob.data_ptr() % HUGE_PAGE == 0  # the arena's first view starts on a huge page
    assert blob.untyped_storage().nbytes() % HUGE_PAGE == 0
    assert int(index[:, 1].max()) > 0 and bool(blob.abs().sum() > 0)
