"""Penalties against a loop reference, logprobs, and seeded sampling that does not depend on
the batch around it (torch and Triton samplers)."""
from __future__ import annotations

import pytest
import torch

from tritonserve.engine import LLM, SamplingParams
from tritonserve.engine.sampling_state import apply_penalties


def loop_reference(logits, prompt, output, repetition, presence, frequency):
    logits = logits.clone()
    for token in range(logits.shape[0]):
        count = output.count(token)
        if token in prompt or count:
            logits[token] = (logits[token] / repetition if logits[token] > 0
                             else logits[token] * repetition)
        logits[token] -= frequency * count
        if count:
            logits[token] -= presence
    return logits


def test_penalties_match_loop_reference():
    gen = torch.Generator().manual_seed(0)
    vocab, batch = 50, 4
    logits = torch.randn(batch, vocab, generator=gen) * 3
    prompts = [[1, 2, 3], [4, 4, 9], [], [10, 11]]
    outputs = [[2, 2, 5], [], [7, 7, 7, 8], [11, 12, 12]]
    rep = [1.3, 1.0, 0.8, 2.0]
    pres = [0.5, -0.3, 0.0, 1.5]
    freq = [0.2, 0.0, -0.7, 1.0]
    prompt_mask = torch.zeros(batch, vocab, dtype=torch.bool)
    counts = torch.zeros(batch, vocab)
    for row in range(batch):
        prompt_mask[row, prompts[row]] = True
        for t in outputs[row]:
            counts[row, t] += 1
    got = apply_penalties(logits, prompt_mask, counts, torch.tensor(rep), torch.tensor(pres),
                          torch.tensor(freq))
    for row in range(batch):
        want = loop_reference(logits[row], prompts[row], outputs[row], rep[row], pres[row],
                              freq[row])
        torch.testing.assert_close(got[row], want)


@pytest.fixture(scope="module", params=["torch", "triton"])
def llm(request, tiny_model):
    return LLM(tiny_model, sampler_backend=request.param)


def test_seeded_sampling_ignores_batch_composition(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=40, seed=1234, max_tokens=10)
    alone = llm.generate(["The quick brown fox"], params)[0].token_ids
    crowd = ["Hello world", "The quick brown fox", "def main():", "Paged attention"]
    crowd_params = [SamplingParams(temperature=0.8, max_tokens=14),
                    params,
                    SamplingParams(temperature=1.0, seed=99, max_tokens=6),
                    SamplingParams(temperature=0.0, max_tokens=10)]
    outs = llm.generate(crowd, crowd_params)
    assert outs[1].token_ids == alone
    # the seeded row that filters nothing (on the CPU the C++ draw's row, whatever the rest
    # of the batch takes) samples alone what it sampled in the crowd
    assert llm.generate(["def main():"], crowd_params[2])[0].token_ids == outs[2].token_ids
    other_seed = llm.generate(["The quick brown fox"],
                              SamplingParams(temperature=1.0, top_p=0.9, top_k=40, seed=4321,
                                             max_tokens=10))[0].token_ids
    assert other_seed != alone


def test_greedy_batches_draw_no_seeds(tiny_model):
    """An all-greedy batch takes the C++ draw's argmax (on the CPU) with no seeds drawn: an
    unseeded sampled request after greedy ones samples what it samples on a fresh engine of
    the same seed, and greedy output is torch.argmax's."""
    sampled = SamplingParams(temperature=1.0, max_tokens=8)
    fresh = LLM(tiny_model, seed=7).generate(["Paged attention"], sampled)[0].token_ids
    llm = LLM(tiny_model, seed=7)
    greedy = llm.generate(["Hello world", "def main():"],
                          SamplingParams(temperature=0.0, max_tokens=6))
    assert llm.generate(["Paged attention"], sampled)[0].token_ids == fresh
    again = LLM(tiny_model, seed=8).generate(["Hello world", "def main():"],
                                             SamplingParams(temperature=0.0, max_tokens=6))
    assert [o.token_ids for o in again] == [o.token_ids for o in greedy]


def test_logprobs_are_sorted_and_consistent(tiny_model):
    llm = LLM(tiny_model)
    out = llm.generate(["Hello world"], SamplingParams(temperature=0.0, max_tokens=4,
                                                       logprobs=5))[0]
    assert len(out.logprobs) == 4
    for token in out.logprobs:
        values = [t.logprob for t in token.top_logprobs]
        assert len(values) == 5 and values == sorted(values, reverse=True)
        assert token.top_logprobs[0].token_id == token.token_id  # greedy: the top one
        assert token.logprob == pytest.approx(values[0])
        assert sum(pow(2.718281828, v) for v in values) <= 1.0 + 1e-5


def test_repetition_penalty_changes_greedy_output(tiny_model):
    llm = LLM(tiny_model)
    plain = llm.generate(["la la la"], SamplingParams(temperature=0.0, max_tokens=12))[0]
    penalised = llm.generate(["la la la"], SamplingParams(temperature=0.0, max_tokens=12,
                                                          repetition_penalty=5.0))[0]
    assert len(set(penalised.token_ids)) >= len(set(plain.token_ids))
    assert penalised.token_ids != plain.token_ids


def _sample_args(batch: int = 5, vocab: int = 64, seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=gen) * 2
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.3, 1.0][:batch])
    top_k = torch.tensor([0, 0, 5, 0, 20][:batch], dtype=torch.int32)
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.9, 0.8][:batch])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.05][:batch])
    seeds = torch.randint(0, 1 << 62, (batch,), generator=gen)
    return logits, temperature, top_k, top_p, min_p, seeds


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sample_op_matches_the_kernel_it_names(backend):
    """tritonserve::sample is the registered door to both samplers: the same tokens as the
    direct call (the Triton one interpreted here, on CUDA in tritonserve/bench/gpu_check.sh)."""
    from tritonserve.kernels import triton as kernels
    from tritonserve.kernels import reference
    args = _sample_args()
    direct = (kernels.sample if backend == "triton" else reference.sample)(*args)
    via_op = torch.ops.tritonserve.sample(*args, backend=backend)
    assert via_op.dtype == torch.int64 and torch.equal(via_op, direct)
    assert via_op[0] == args[0][0].argmax()  # temperature 0: the exact argmax


def test_sample_op_passes_opcheck_and_compiles_without_graph_breaks():
    """The fake implementation agrees with the real one (torch.library.opcheck), and a
    fullgraph torch.compile of logits -> temperature-scaled -> sampled token calls the op from
    the graph and draws the same tokens as eager."""
    import tritonserve.engine.sampler  # noqa: F401  (registers the op)
    args = _sample_args()
    torch.library.opcheck(torch.ops.tritonserve.sample.default, (*args, "torch"))

    def step(logits, temperature, top_k, top_p, min_p, seeds):
        scaled = torch.log_softmax(logits, dim=-1)  # traced work around the op
        return torch.ops.tritonserve.sample(scaled, temperature, top_k, top_p, min_p, seeds,
                                            backend="torch")

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(*args), step(*args))


def test_the_triton_draw_takes_plain_rows_and_torch_the_filtering_ones():
    """draw "triton" (CUDA's plan): rows that filter nothing go through the kernel, rows with
    top-k / top-p / min-p through the torch path (faster there at a large vocabulary:
    docs/benchmarks.md "On a GPU"), each row by its own parameters, so a seeded row draws the
    same token alone or in a mixed batch."""
    from tritonserve.engine.sampler import Sampler
    from tritonserve.kernels import reference
    from tritonserve.kernels import triton as kernels
    logits, temperature, top_k, top_p, min_p, seeds = _sample_args()
    params = [SamplingParams(temperature=float(t), top_k=int(k), top_p=float(p),
                             min_p=float(m))
              for t, k, p, m in zip(temperature, top_k, top_p, min_p)]
    sampler = Sampler("triton", logits.shape[1], seed=0, max_model_len=64)
    got = sampler._draw(logits.clone(), params, seeds)
    plain = [0, 1]  # greedy and T = 1: no filter
    filtering = [2, 3, 4]
    zeros = torch.zeros(2, dtype=torch.int32)
    assert torch.equal(got[plain], kernels.sample(
        logits[plain], temperature[plain], zeros, torch.ones(2), torch.zeros(2), seeds[plain]))
    assert torch.equal(got[filtering], reference.sample(
        logits[filtering], temperature[filtering], top_k[filtering], top_p[filtering],
        min_p[filtering], seeds[filtering]))
    for row in range(len(params)):  # alone = in company
        alone = sampler._draw(logits[row:row + 1].clone(), params[row:row + 1], seeds[row:row + 1])
        assert int(alone) == int(got[row])
