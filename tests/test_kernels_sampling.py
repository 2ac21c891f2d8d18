"""The sampling kernel (interpreted on the CPU) and its torch reference: exact greedy, never a
masked token, the renormalised distribution (chi-square), same seeds -> same tokens."""
from __future__ import annotations

import pytest
import torch

from tritonserve.kernels import triton as kernels

from tritonserve.kernels import cpu, reference

SAMPLERS = {"triton": kernels.sample, "torch": reference.sample}
# chi-square 0.999 quantiles by degrees of freedom (fixed seeds: the test is deterministic)
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12,
            9: 27.88, 10: 29.59, 11: 31.26, 12: 32.91, 13: 34.53, 14: 36.12, 15: 37.70}


def params(batch, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed0=0, device="cpu"):
    return tuple(t.to(device) for t in (
        torch.full((batch,), float(temperature)), torch.full((batch,), top_k, dtype=torch.int32),
        torch.full((batch,), float(top_p)), torch.full((batch,), float(min_p)),
        torch.arange(seed0, seed0 + batch, dtype=torch.int64) * 7919 + 13))


def expected_distribution(logits, temperature, top_k, top_p, min_p):
    """The renormalised target, by sorting (written independently of both samplers)."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    k = top_k if 0 < top_k < len(probs) else len(probs)
    keep[order[:k]] = True
    kept_mass = probs[keep].sum()
    running = 0.0
    for rank, token in enumerate(order[:k].tolist()):
        running += float(probs[token])
        if running >= top_p * float(kept_mass) - 1e-12:
            keep[order[rank + 1:]] = False
            break
    keep &= probs >= min_p * probs.max()
    target = torch.where(keep, probs, 0.0)
    return target / target.sum(), keep


@pytest.mark.parametrize("name", SAMPLERS)
def test_greedy_is_exact_argmax(name, device):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(37, 300, generator=gen)
    logits[3, 10] = logits[3, 11] = logits[3].max() + 1  # a tie: the first index wins
    tokens = SAMPLERS[name](logits.to(device), *params(37, temperature=0.0, top_k=5, top_p=0.5,
                                                      device=device)).cpu()
    assert torch.equal(tokens, logits.argmax(dim=-1))
    assert int(tokens[3]) == 10


CASES = [
    # (temperature, top_k, top_p, min_p)
    (1.0, 0, 1.0, 0.0),
    (0.7, 5, 1.0, 0.0),
    (1.0, 0, 0.8, 0.0),
    (1.3, 0, 1.0, 0.1),
    (1.0, 8, 0.9, 0.05),
    (2.0, 0, 0.3, 0.0),  # a small nucleus: several rejection draws per row
    (0.5, 4, 1.0, 0.2),
]


@pytest.mark.slow
@pytest.mark.parametrize("name", SAMPLERS)
@pytest.mark.parametrize("temperature,top_k,top_p,min_p", CASES)
def test_samples_follow_renormalised_distribution(name, temperature, top_k, top_p, min_p,
                                                  device):
    vocab, draws = 16, 2000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(5)) * 1.5
    target, keep = expected_distribution(logits, temperature, top_k, top_p, min_p)
    batch = logits.expand(draws, vocab).contiguous()
    tokens = SAMPLERS[name](batch.to(device), *params(draws, temperature, top_k, top_p, min_p,
                                                       device=device)).cpu()
    assert bool(keep[tokens].all()), f"sampled a masked token: {set(tokens[~keep[tokens]].tolist())}"
    counts = torch.bincount(tokens, minlength=vocab).double()
    kept = keep.nonzero().squeeze(1)
    expected = target[kept] * draws
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    dof = len(kept) - 1
    if dof:
        assert chi2 < CHI2_999[dof], f"chi2 {chi2:.1f} with {dof} dof"


def test_rejection_fallback_follows_the_distribution(monkeypatch):
    """With one top-p draw allowed, most rows take the full-sort fallback: still exact."""
    monkeypatch.setattr(reference, "MAX_ATTEMPTS", 1)
    test_samples_follow_renormalised_distribution("torch", 1.5, 0, 0.6, 0.0, "cpu")


def test_top_k_above_the_candidate_limit_follows_the_distribution(monkeypatch):
    """A top_k too large for the candidate path takes softmax + thresholds: still exact."""
    monkeypatch.setattr(reference, "TOPK_CANDIDATES", 2)
    test_samples_follow_renormalised_distribution("torch", 1.0, 8, 0.9, 0.05, "cpu")
    test_samples_follow_renormalised_distribution("torch", 0.5, 4, 1.0, 0.2, "cpu")


@pytest.mark.parametrize("name", SAMPLERS)
def test_same_seeds_same_tokens_and_rows_independent(name, device):
    logits = torch.randn(24, 200, generator=torch.Generator().manual_seed(2)).to(device)
    args = params(24, temperature=1.0, top_k=50, top_p=0.95, device=device)
    first = SAMPLERS[name](logits, *args)
    again = SAMPLERS[name](logits, *args)
    assert torch.equal(first, again)
    # row 5 alone, with its own seed, samples what it sampled inside the batch
    single = SAMPLERS[name](logits[5:6].contiguous(), *(a[5:6] for a in args))
    assert int(single[0]) == int(first[5])
    other_seeds = SAMPLERS[name](logits, *args[:4], args[4] + 1)
    assert not torch.equal(first, other_seeds)


@pytest.mark.parametrize("name", SAMPLERS)
def test_mixed_rows_in_one_batch(name, device):
    """Greedy, top-k 1 and filtered rows side by side each obey their own parameters."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 1500, generator=gen)  # > one 1024-wide chunk in the interpreter
    temperature = torch.tensor([0.0, 1.0, 1.0, 0.5, 1.0, 2.0])
    top_k = torch.tensor([0, 1, 3, 0, 0, 0], dtype=torch.int32)
    top_p = torch.tensor([1.0, 1.0, 1.0, 1e-6, 1.0, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 0.0])
    seeds = torch.arange(6, dtype=torch.int64)
    tokens = SAMPLERS[name](*(t.to(device) for t in (logits, temperature, top_k, top_p, min_p,
                                                     seeds))).cpu()
    argmax = logits.argmax(dim=-1)
    assert int(tokens[0]) == int(argmax[0])
    assert int(tokens[1]) == int(argmax[1])  # top-k 1
    assert int(tokens[2]) in logits[2].topk(3).indices.tolist()
    assert int(tokens[3]) == int(argmax[3])  # tiny top-p keeps only the top token
    assert int(tokens[4]) == int(argmax[4])  # min-p 1 keeps only the top token


@pytest.mark.slow
def test_gpu_large_vocabulary_path(device):
    """The shape the GPU takes for a large vocabulary (one row per program, 4096-wide chunks,
    vocab > 4096 so the loops run twice) gives the right tokens (interpreted here, compiled on
    CUDA by gpu_check.sh)."""
    gen = torch.Generator().manual_seed(7)
    vocab = 5000
    logits = torch.randn(3, vocab, generator=gen) * 3
    logits[:, 4500] = logits.max() + 2  # the top token sits in the second chunk
    temperature = torch.tensor([0.0, 1.0, 1.0])
    top_k = torch.tensor([0, 3, 0], dtype=torch.int32)
    top_p = torch.tensor([1.0, 1.0, 1e-6])
    min_p = torch.zeros(3)
    seeds = torch.arange(3, dtype=torch.int64)
    tokens = kernels.sample(*(t.to(device) for t in (logits, temperature, top_k, top_p, min_p,
                                                      seeds)), block_rows=1, block_v=4096).cpu()
    assert int(tokens[0]) == 4500
    assert int(tokens[1]) in logits[1].topk(3).indices.tolist()
    assert int(tokens[2]) == 4500


def test_seeded_uniforms_are_counter_based():
    """One uniform per row from its seed alone, the same in any batch; spread over [0, 1)."""
    seeds = torch.arange(20000, dtype=torch.int64) * 7919 + 13
    u = reference.uniform_from_seeds(seeds)
    assert torch.equal(reference.uniform_from_seeds(seeds[5:6]), u[5:6])
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    counts = torch.histc(u.float(), bins=10, min=0, max=1)
    chi2 = float(((counts - 2000) ** 2 / 2000).sum())
    assert chi2 < 27.88  # 9 dof, 0.999


CPP_DRAW = cpu.op("sample_softmax")
needs_cpp = pytest.mark.skipif(CPP_DRAW is None, reason="no C++ toolchain: the torch path serves")


@needs_cpp
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_cpp_softmax_draw_follows_the_distribution(temperature):
    """kernels/cpu/sampling.cpp (the CPU's draw for rows that filter nothing): chi-square
    against softmax(logits / T), and a banned (-inf) token is never drawn."""
    vocab, draws = 16, 4000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(5)) * 1.5
    logits[3] = float("-inf")
    target = torch.softmax(logits.double() / temperature, dim=-1)
    temps, _, _, _, seeds = params(draws, temperature)
    tokens = CPP_DRAW(logits.expand(draws, vocab).contiguous(), temps, seeds)
    assert tokens.dtype == torch.int64 and not bool((tokens == 3).any())
    counts = torch.bincount(tokens, minlength=vocab).double()
    kept = (target > 0).nonzero().squeeze(1)
    expected = target[kept] * draws
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_999[len(kept) - 1], f"chi2 {chi2:.1f}"


@needs_cpp
def test_cpp_softmax_draw_is_the_reference_draw():
    """Same uniform (the row's seed), same inverse-CDF rule: the C++ draw and the torch path
    pick the same token, a 49k vocabulary, greedy rows included (the first maximum). Their
    fp32 roundings differ, so a uniform within ~1e-7 of a CDF step could split them: none did
    in these 1,920 draws; two are allowed so another CPU's rounding does not fail the test."""
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 49152, generator=gen) * 3).bfloat16().float()  # ties, as served
    mismatches = 0
    for trial in range(30):
        seeds = torch.randint(0, 1 << 62, (64,), generator=gen)
        temps = torch.rand(64, generator=gen) * 1.5 + 0.1
        temps[:4], temps[4:8] = 0.0, 1.0
        _, top_k, top_p, min_p, _ = params(64)
        want = reference.sample(logits, temps, top_k, top_p, min_p, seeds)
        got = CPP_DRAW(logits, temps, seeds)
        assert torch.equal(got[:4], logits[:4].argmax(dim=-1))
        mismatches += int((got != want).sum())
    assert mismatches <= 2


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 63, 64, 200, 49152])
def test_cpp_greedy_rows_are_torch_argmax(dtype, vocab):
    """T = 0 rows: torch.argmax's index (the first maximum) in the one-pass lane search,
    whatever the vocabulary's remainder after the 64-wide passes: a row of ties, the max in
    the tail, two maxima in the second half, an all -inf row, and random rows."""
    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(12, vocab, generator=gen) * 3).to(dtype)
    logits[0] = 1.0
    logits[1, -1] = 50.0
    logits[2, vocab // 2:] = 99.0
    logits[3] = float("-inf")
    logits[4, vocab - 1 - (vocab // 3)] = 40.0
    logits[4, vocab // 3] = 40.0
    got = CPP_DRAW(logits, torch.zeros(12), torch.zeros(12, dtype=torch.int64))
    assert torch.equal(got, logits.float().argmax(dim=-1))


@needs_cpp
def test_cpp_softmax_draw_rows_are_independent():
    logits = torch.randn(24, 500, generator=torch.Generator().manual_seed(2))
    temps, _, _, _, seeds = params(24, 0.9)
    first = CPP_DRAW(logits, temps, seeds)
    assert torch.equal(first, CPP_DRAW(logits, temps, seeds))
    assert int(CPP_DRAW(logits[5:6], temps[5:6], seeds[5:6])[0]) == int(first[5])
    assert not torch.equal(first, CPP_DRAW(logits, temps, seeds + 1))
    # bf16 logits as the model gives them: the draw of their exact fp32 values
    rounded = logits.bfloat16()
    assert torch.equal(CPP_DRAW(rounded, temps, seeds), CPP_DRAW(rounded.float(), temps, seeds))
    with pytest.raises(RuntimeError, match="float32 or bfloat16 logits"):
        CPP_DRAW(logits.half(), temps, seeds)
    with pytest.raises(RuntimeError, match="seeds"):
        CPP_DRAW(logits, temps, seeds[:3])
