"""long_prefill_tokens (--long-prefill-tokens): while another request decodes, a prompt longer
than the cap computes at most that many tokens a step, so the streams beside it wait for short
steps; alone it takes the whole budget. And `bench long-context`: its TPOT rows by context, and
`--beside`, which measures the trade-off (docs/benchmarks.md, long context)."""
from __future__ import annotations

import pytest

from tritonserve.engine import LLMEngine, SamplingParams
from tritonserve.engine.llm import build_config


def spy_schedule(engine: LLMEngine) -> list[list[tuple[str, int]]]:
    """Each step's (request id, tokens scheduled), appended as the engine schedules."""
    chunks: list[list[tuple[str, int]]] = []
    schedule = engine.scheduler.schedule

    def spied():
        out = schedule()
        chunks.append([(s.request.request_id, s.num_new_tokens) for s in out.scheduled])
        return out

    engine.scheduler.schedule = spied
    return chunks


def _prompt(engine: LLMEngine, n: int) -> list[int]:
    ids = engine.tokenize("paged attention keeps keys and values in blocks of tokens " * 40)
    assert len(ids) >= n
    return ids[:n]


def _run(tiny_model, cap: int | None, beside: bool) -> tuple[list[int], list]:
    engine = LLMEngine(build_config(tiny_model, long_prefill_tokens=cap,
                                    max_num_batched_tokens=256))
    chunks = spy_schedule(engine)
    if beside:
        engine.add_request(_prompt(engine, 5), SamplingParams(max_tokens=60, ignore_eos=True),
                           "stream")
        engine.step()  # its prefill: it decodes from now on
    chunks.clear()
    engine.add_request(_prompt(engine, 200), SamplingParams(max_tokens=4, temperature=0.0,
                                                            ignore_eos=True), "long")
    tokens = []
    while "long" in engine._requests:
        for step in engine.step():
            if step.request_id == "long" and step.token is not None:
                tokens.append(step.token.token_id)
    return tokens, chunks


def test_a_long_prompt_beside_a_stream_takes_chunks_of_the_cap(tiny_model):
    tokens, chunks = _run(tiny_model, 48, beside=True)
    prefill = [n for step in chunks for rid, n in step if rid == "long"][:-3]  # then decodes
    assert sum(prefill) == 200 and max(prefill) == 48, prefill
    # every one of those steps gave the stream its token too
    assert all(any(rid == "stream" for rid, _ in step) for step in chunks[:len(prefill)])
    # the chunks change the schedule, not the tokens
    uncapped, _ = _run(tiny_model, None, beside=True)
    assert tokens == uncapped and len(tokens) == 4


def test_alone_or_short_a_prompt_takes_the_whole_budget(tiny_model):
    _, chunks = _run(tiny_model, 48, beside=False)  # nothing decodes beside it
    assert chunks[0] == [("long", 200)]
    _, chunks = _run(tiny_model, 300, beside=True)  # not longer than the cap
    assert ("long", 200) in chunks[0]


def test_the_default_caps_on_the_cpu_only(tiny_model):
    from tritonserve.engine.config import SchedulerConfig
    assert SchedulerConfig().long_prefill_tokens_on("cpu") == 256
    assert SchedulerConfig().long_prefill_tokens_on("cuda") is None
    assert SchedulerConfig(long_prefill_tokens=64).long_prefill_tokens_on("cuda") == 64
    assert LLMEngine(build_config(tiny_model)).scheduler.long_prefill_tokens == 256


def test_the_option_names_itself(tiny_model):
    with pytest.raises(ValueError, match="long_prefill_tokens"):
        build_config(tiny_model, long_prefill_tokens=0)
    from tritonserve.server.__main__ import engine_config, parse_args
    config = engine_config(parse_args(["--model", tiny_model, "--long-prefill-tokens", "96"]))
    assert config.scheduler.long_prefill_tokens == 96


def test_the_beside_bench_reports_ttft_and_the_streams_gaps(tiny_model, capsys):
    from tritonserve.bench import long_context
    assert long_context.main(["--model", tiny_model, "--beside", "2", "--prompt", "120",
                              "--long-prefill-tokens", "32"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("2 streams, then a 120-token prompt: TTFT")
    steps = int(line.split(" over ")[1].split()[0])
    assert steps >= 120 // 32  # the prompt in chunks of at most 32 while the streams decode


@pytest.mark.parametrize("sampling", [[], ["--default-sampling"]])
def test_the_long_context_bench_prints_a_row_a_context(tiny_model, capsys, sampling):
    from tritonserve.bench import long_context
    assert long_context.main(["--model", tiny_model, "--contexts", "16,200", "--tokens", "4",
                              *sampling]) == 0
    rows = [line.split() for line in capsys.readouterr().out.strip().splitlines()[-2:]]
    assert [int(r[0]) for r in rows] == [16, 200]
    assert all(float(r[1]) > 0 and r[2].endswith("x") for r in rows)
