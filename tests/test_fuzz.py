"""A bounded fuzz over the three routes: whatever the body, the answer is never a 5xx, a
served stream never ends with an engine error, and a normal request still streams correctly
afterwards. FUZZ_EXAMPLES (default 150 per route) raises the count for a longer run
(docs/perf-log/2026-11-engine-and-serving.md has the figure of the last one). The server
speculates (n-gram proposals) on every step it can."""
from __future__ import annotations

import json
import os
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tritonserve.engine import LLMEngine
from tritonserve.engine.llm import build_config
from tests.server_util import ServerThread, request, sse_payloads
from tests.test_server import validate_native

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "150"))
ROUTES = ["/generate", "/v1/completions", "/v1/chat/completions"]

WEIRD_INTS = st.sampled_from([-(2**63), -2, -1, 0, 1, 2, 3, 5, 2**31, 2**40, 2**63, 2**64,
                              10**30])
WEIRD_FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                         st.sampled_from([0.0, -0.0, 1e-300, 1e-30, 0.01, 0.5, 1.0, 2.0,
                                          1e30, 1e308]))
TEXT = st.one_of(st.text(max_size=40),
                 st.sampled_from(["\ud800", "a\udfff", "\x00", "### END", "😀", ""]))
SCALAR = st.one_of(st.none(), st.booleans(), WEIRD_INTS, WEIRD_FLOATS, TEXT)
VALUE = st.recursive(SCALAR, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.one_of(TEXT, WEIRD_INTS.map(str)), inner,
                                                 max_size=4)), max_leaves=12)
def mostly(plausible, weird=VALUE):
    """Most of the time a value a client might send, else anything at all (one_of would
    not do: Hypothesis does not draw its branches evenly)."""
    return st.integers(0, 15).flatmap(lambda i: weird if i == 7 else plausible)


TOKEN = st.integers(0, 400)
SAMPLING = {
    "max_tokens": mostly(st.integers(1, 6)), "temperature": mostly(st.floats(0, 2)),
    "top_k": mostly(st.one_of(st.integers(-1, 100), st.just(2**64))),
    "top_p": mostly(st.floats(0.01, 1)), "min_p": mostly(st.floats(0, 1)),
    "seed": mostly(st.integers(0, 2**64 - 1)),
    "repetition_penalty": mostly(st.floats(0.5, 2)),
    "presence_penalty": mostly(st.floats(-2, 2)), "frequency_penalty": mostly(st.floats(-2, 2)),
    "min_tokens": mostly(st.integers(0, 3)),
    "stop": mostly(st.one_of(TEXT, st.lists(TEXT, max_size=3))),
    "stop_token_ids": mostly(st.lists(TOKEN, max_size=3)),
    "ignore_eos": mostly(st.booleans()),
    "logit_bias": mostly(st.dictionaries(TOKEN.map(str), st.floats(-100, 100), max_size=3)),
    "logprobs": mostly(st.integers(0, 20)), "skip_special_tokens": mostly(st.booleans()),
    "stream": mostly(st.booleans()), "include_stop_str_in_output": mostly(st.booleans()),
    "n": mostly(st.just(1)), "user": mostly(TEXT),
}

PROMPT = mostly(st.one_of(TEXT, st.lists(TOKEN, min_size=1, max_size=6)),
                st.lists(st.one_of(TOKEN, WEIRD_INTS), max_size=6))
MESSAGE = st.fixed_dictionaries(
    {"role": mostly(st.sampled_from(["user", "system", "assistant"])),
     "content": mostly(TEXT)})
MESSAGES = mostly(st.lists(MESSAGE, min_size=1, max_size=3))


def body_for(route: str):
    """Mostly plausible bodies (so many run), each field sometimes nonsense."""
    first = ({"messages": MESSAGES} if route.endswith("chat/completions")
             else {"prompt": PROMPT})
    fields = mostly(st.fixed_dictionaries(first, optional=SAMPLING),
                    st.fixed_dictionaries({**first, "unknown_field": VALUE}))
    raw_bodies = st.one_of(st.binary(max_size=64), VALUE.map(lambda v: json.dumps(v)
                                                             .encode()))
    return mostly(fields.map(lambda d: json.dumps(d).encode()), raw_bodies)


@pytest.fixture(scope="module")
def server(tiny_model):
    """With n-gram speculation on (one-token matches: proposals on most steps), so every body
    also runs through the speculating path (engine/speculative.py)."""
    srv = ServerThread(LLMEngine(build_config(tiny_model, max_num_seqs=8, max_model_len=128,
                                              speculative_method="ngram",
                                              num_speculative_tokens=3, ngram_min=1,
                                              speculative_min_acceptance=0.0)))
    yield srv
    srv.stop()


def check_answer(route: str, status: int, raw: bytes) -> None:
    assert status < 500, (status, raw[:300])
    if status != 200 or not raw.startswith(b"data: "):
        json.loads(raw)  # every non-stream answer is JSON
        return
    payloads = sse_payloads(raw)
    if route == "/generate":
        events = validate_native(payloads)
        assert events[-1].type == "done", events[-1]
    else:
        assert payloads[-1] == "[DONE]"
        assert not any(isinstance(p, dict) and "error" in p for p in payloads), payloads


@pytest.mark.slow
@pytest.mark.parametrize("route", ROUTES)
def test_no_body_gets_a_5xx(server, route):
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(raw=body_for(route))
    def fuzz(raw):
        status, _, answer = request(server.port, "POST", route, raw, timeout=60)
        statuses[status] += 1
        check_answer(route, status, answer)

    statuses: Counter[int] = Counter()
    fuzz()
    print(f"{route}: {sum(statuses.values())} bodies, statuses {dict(sorted(statuses.items()))}")
    events = validate_native(sse_payloads(request(server.port, "POST", "/generate", {
        "prompt": "still fine", "max_tokens": 5, "temperature": 0, "ignore_eos": True,
        "stream": True})[2]))
    assert events[-1].type == "done" and events[-1].output_tokens == 5
    assert server.engine.kv_cache.num_used_blocks == 0
