"""One request can never freeze the others (issue "No request can freeze the others"): a test
per hostile input or fault. Each one failed before its fix: grammars compiled on the event loop,
a data-parallel send under the front end's lock, unbounded stop lists, a stale abort, token 0
drawn from an all-forbidden row, quadratic tool-call scans, unconfined index paths, raw
tracebacks, server paths shown, and a tensor-parallel engine dying of one batch's error.
Assertions are on order and outcome (what answered while what was still running), never on
how fast."""
from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import statistics
import threading

import pytest

from tritonserve.engine import LLMEngine, SamplingParams
from tritonserve.engine.limits import RequestLimits
from tritonserve.engine.llm import build_config
from tritonserve.server.common import STATE
from tests.server_util import ServerThread, request, sse_payloads
from tests.test_server import validate_native

LIMITS = RequestLimits()


def nested_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for i in range(levels):
        schema = {"type": "object", "properties": {f"a{i}": schema}, "required": [f"a{i}"]}
    return schema


def choices(count: int) -> list[str]:
    return [f"choice number {i} xyz" for i in range(count)]


def send_in_background(port: int, path: str, body: dict, timeout: float = 300) -> tuple:
    answer: dict = {}

    def send() -> None:
        answer["status"], _, answer["raw"] = request(port, "POST", path, body, timeout=timeout)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread, answer


def health_while(port: int, thread: threading.Thread) -> int:
    """Probes /health until `thread` ends; every probe must answer 200 (a loop that blocks
    fails the probe's timeout). -> how many answered."""
    answered = 0
    while thread.is_alive():
        assert request(port, "GET", "/health", timeout=15)[0] == 200
        answered += 1
    return answered


def hold_compiles(engine) -> tuple[threading.Semaphore, threading.Event]:
    """Every grammar compile of `engine` waits for the event: (a semaphore released as each
    compile starts, the event)."""
    compiling, release = threading.Semaphore(0), threading.Event()
    compile_ = engine.grammars.compile

    def held(grammar, spec):
        compiling.release()
        release.wait(60)
        return compile_(grammar, spec)

    engine.grammars.compile = held
    return compiling, release


def error_param(raw: bytes) -> str:
    return json.loads(raw)["error"]["param"]


# ---- grammars: bounded, and compiled off the event loop ---------------------------------
@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "deep", "schema": nested_schema(480)}}}, "response_format"),
    ({"guided_choice": choices(20_000)}, "guided_choice"),
    ({"guided_regex": "a" * (LIMITS.max_grammar_chars + 1)}, "guided_regex"),
])
def test_a_grammar_past_the_limits_is_refused_while_health_answers(server, body, param):
    """A 480-level schema held /health 10 s and 20k choices 20.6 s, then served: now a 400
    naming the field, and /health answers all the while."""
    thread, answer = send_in_background(server.port, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body})
    health_while(server.port, thread)
    thread.join()
    assert answer["status"] == 400, answer["raw"][:300]
    assert error_param(answer["raw"]) == param


def test_a_grammar_compiles_off_the_event_loop(tiny_model):
    """While a grammar compiles, /health answers: the compile runs on a worker thread."""
    engine = LLMEngine(build_config(tiny_model))
    compiling, release = hold_compiles(engine)
    srv = ServerThread(engine)
    try:
        thread, answer = send_in_background(srv.port, "/v1/completions", {
            "prompt": "x", "max_tokens": 3, "guided_choice": ["yes", "no"]})
        assert compiling.acquire(timeout=60)
        assert request(srv.port, "GET", "/health", timeout=15)[0] == 200
        assert not release.is_set() and thread.is_alive()  # answered mid-compile
        release.set()
        thread.join()
        assert answer["status"] == 200, answer["raw"]
        assert json.loads(answer["raw"])["choices"][0]["text"] in ("yes", "no")
    finally:
        release.set()
        srv.stop()


def test_a_grammar_past_the_time_limit_gets_400_naming_its_field(tiny_model):
    engine = LLMEngine(build_config(tiny_model, grammar_timeout=0.5))
    _, release = hold_compiles(engine)
    srv = ServerThread(engine)
    try:
        status, _, raw = request(srv.port, "POST", "/v1/completions", {
            "prompt": "x", "max_tokens": 3, "guided_regex": "[a-z]+"})
        assert status == 400 and error_param(raw) == "guided_regex"
        assert "did not compile within 0.5 s" in json.loads(raw)["error"]["message"]
        release.set()
        status, _, raw = request(srv.port, "POST", "/generate", {"prompt": "x",
                                                                 "max_tokens": 3})
        assert status == 200, raw  # nothing was queued for the refused one
    finally:
        release.set()
        srv.stop()


# ---- bounded inputs -------------------------------------------------------------------------
@pytest.mark.parametrize("body,param", [
    ({"stop": [f"s{i}" for i in range(LIMITS.max_stop + 1)]}, "stop"),
    ({"stop": ["x" * (LIMITS.max_stop_chars + 1)]}, "stop"),
    ({"stop_token_ids": [1] * (LIMITS.max_stop_token_ids + 1)}, "stop_token_ids"),
    ({"logit_bias": {str(i): 1.0 for i in range(LIMITS.max_logit_bias + 1)}}, "logit_bias"),
])
def test_unbounded_lists_are_refused_by_name(server, body, param):
    """370k stop strings cost ~0.14 s of engine time a token (every neighbour waited)."""
    flag = f"--max-{param.replace('_', '-')}"
    for path in ("/generate", "/v1/completions"):
        status, _, raw = request(server.port, "POST", path, {"prompt": "x", "max_tokens": 2,
                                                               **body})
        assert status == 400 and error_param(raw) == param, raw[:300]
        assert flag in json.loads(raw)["error"]["message"]  # the bound, not another rule


def test_messages_and_tools_are_bounded_before_the_template(server):
    many = [{"role": "user", "content": ""}] * (LIMITS.max_messages + 1)
    status, _, raw = request(server.port, "POST", "/v1/chat/completions", {"messages": many})
    assert status == 400 and error_param(raw) == "messages"
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    status, _, raw = request(server.port, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [tool] * (LIMITS.max_tools + 1)})
    assert status == 400 and error_param(raw) == "tools"
    big = {"type": "function", "function": {"name": "f", "description": "d" *
                                            LIMITS.max_tools_chars}}
    status, _, raw = request(server.port, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "tools": [big]})
    assert status == 400 and error_param(raw) == "tools"


def test_the_character_bound_counts_every_part_of_a_message(server):
    """Text in a message's name and tool calls counts too: refused by its characters, before
    the tokenizer sees it."""
    status, _, raw = request(server.port, "GET", "/v1/models")
    max_len = json.loads(raw)["data"][0]["max_model_len"]
    call = {"id": "c", "type": "function", "function": {"name": "f",
                                                         "arguments": "x" * max_len * 64}}
    status, _, raw = request(server.port, "POST", "/v1/chat/completions", {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [call]}], "max_tokens": 2})
    assert status == 400 and error_param(raw) == "messages"
    assert "characters cannot fit" in json.loads(raw)["error"]["message"]


# ---- sampling never draws what every rule forbids -------------------------------------------
def test_grammar_with_min_tokens_is_refused_before_it_starts(server):
    status, _, raw = request(server.port, "POST", "/v1/completions", {
        "prompt": "x", "max_tokens": 8, "min_tokens": 4, "guided_choice": ["a", "b"]})
    assert status == 400 and error_param(raw) == "min_tokens"


def test_a_row_with_every_token_banned_ends_that_request_alone(server):
    """stop_token_ids over the whole vocabulary + min_tokens: nothing is left to draw. The
    request ends with an error event naming the conflict (token 0 was drawn before); a
    neighbour in the same batches streams to its end."""
    vocab = server.engine.arch.vocab_size
    neighbour, answer = send_in_background(server.port, "/generate", {
        "prompt": "a b", "max_tokens": 24, "ignore_eos": True, "stream": True})
    status, _, raw = request(server.port, "POST", "/generate", {
        "prompt": "x", "max_tokens": 8, "min_tokens": 4, "stream": True,
        "stop_token_ids": list(range(vocab))})
    events = validate_native(sse_payloads(raw))
    assert status == 200 and events[-1].type == "error", events
    assert "no token is allowed" in events[-1].message
    assert not [e for e in events if e.type == "token"]
    neighbour.join()
    done = validate_native(sse_payloads(answer["raw"]))
    assert done[-1].type == "done" and done[-1].output_tokens == 24


# ---- request ids ----------------------------------------------------------------------------
def test_a_stale_abort_never_ends_a_later_request_with_the_same_id(server):
    """An abort for a choice that had ended (a hang-up racing its last step) stayed queued
    while the engine idled and aborted the next request with that X-Request-Id."""
    body = {"prompt": "x", "max_tokens": 3, "stream": True}

    def generate_with_id() -> list:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        conn.request("POST", "/generate", json.dumps(body).encode(),
                     {"Content-Type": "application/json", "X-Request-Id": "retry-1"})
        raw = conn.getresponse().read()
        conn.close()
        return validate_native(sse_payloads(raw))

    assert generate_with_id()[-1].type == "done"
    host = server.app[STATE].engine
    host.abort("retry-1")  # late: the request has ended
    while True:  # until the engine thread has taken it (and the engine idles again)
        with host.hub.lock:
            if not host.hub._aborts:
                break
        threading.Event().wait(0.01)
    events = generate_with_id()
    assert events[-1].type == "done", events


def test_one_id_twice_while_its_grammar_compiles_is_refused_once(tiny_model):
    """submit awaits the grammar's compile: a second request with the same X-Request-Id,
    sent meanwhile, passed the route's check too and took over the first's stream. Now the
    one that comes second to the engine gets a 400, and the other streams to its end."""
    engine = LLMEngine(build_config(tiny_model))
    compiling, release = hold_compiles(engine)
    srv = ServerThread(engine)
    try:
        body = {"prompt": "x", "max_tokens": 3, "guided_choice": ["yes", "no"]}
        answers = []

        def send() -> None:
            conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
            conn.request("POST", "/v1/completions", json.dumps(body).encode(),
                         {"Content-Type": "application/json", "X-Request-Id": "twice"})
            response = conn.getresponse()
            answers.append((response.status, response.read()))
            conn.close()

        senders = [threading.Thread(target=send) for _ in range(2)]
        for sender in senders:
            sender.start()
        assert compiling.acquire(timeout=60) and compiling.acquire(timeout=60)  # both past
        release.set()  # the route's check, both compiling
        for sender in senders:
            sender.join(60)
        assert sorted(status for status, _ in answers) == [200, 400], answers
        refused = next(raw for status, raw in answers if status == 400)
        assert error_param(refused) == "X-Request-Id"
    finally:
        release.set()
        srv.stop()


def test_the_engine_drops_an_abort_for_an_id_it_does_not_run(tiny_model):
    from tritonserve.engine import LLM
    llm = LLM(tiny_model)
    llm.engine.abort("req-0")  # the id the next request will get
    out = llm.generate(["x"], SamplingParams(max_tokens=3, temperature=0))[0]
    assert out.finish_reason in ("length", "eos")


# ---- tool calls stream in linear time -------------------------------------------------------
def test_tool_call_arguments_are_scanned_once_as_they_stream():
    """8,000 tokens of arguments cost 6.1 s of the event loop: the call text was scanned from
    its start at every delta. Each character is scanned once now, and the streamed pieces
    still join to the whole call's arguments."""
    from tritonserve.server import json_scan
    from tritonserve.server.tool_parsers import ToolCallStream
    scanned = []
    run = json_scan.Scanner._run

    def counting(self, start):
        scanned.append(len(self.text) - start)
        return run(self, start)

    json_scan.Scanner._run = counting
    try:
        stream = ToolCallStream("hermes")
        pieces = ['<tool_call>{"name": "f", "arguments": {"v": ['] + \
            [f"{i}, " for i in range(8000)] + ["0]}}</tool_call>"]
        sent = ""
        for piece in pieces:
            for call in stream.feed(piece).calls:
                sent += call["function"].get("arguments", "")
        stream.finish()
    finally:
        json_scan.Scanner._run = run
    text = "".join(pieces)
    assert sum(scanned) <= 2 * len(text)  # once as it streamed, once more when it closed
    assert sent == stream.calls[0].arguments == '{"v": [' + "".join(
        f"{i}, " for i in range(8000)) + "0]}"


# ---- the operator's side: keys, paths, model names ------------------------------------------
def test_an_api_key_header_that_is_not_utf8_gets_401(tiny_model):
    srv = ServerThread(LLMEngine(build_config(tiny_model)), api_key="sesame")
    try:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        conn.putrequest("GET", "/v1/models")
        conn.putheader("Authorization", b"Bearer \xff\xfe")
        conn.endheaders()
        response = conn.getresponse()
        assert response.status == 401
        assert json.loads(response.read())["error"]["code"] == "invalid_api_key"
        conn.close()
    finally:
        srv.stop()


def test_models_and_the_404_never_show_the_server_path(server, tiny_model):
    status, _, raw = request(server.port, "GET", "/v1/models")
    assert status == 200 and tiny_model not in raw.decode()
    status, _, raw = request(server.port, "POST", "/v1/completions", {
        "model": "nope", "prompt": "x", "max_tokens": 1})
    assert status == 404 and tiny_model not in raw.decode()
    status, _, raw = request(server.port, "POST", "/v1/completions", {  # still accepted
        "model": tiny_model, "prompt": "x", "max_tokens": 1})
    assert status == 200


def test_index_paths_are_confined_to_the_model_folder(tiny_model, tmp_path):
    from tritonserve.engine.models.loader import WeightLoadError
    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "../../../../../../etc/passwd"}}))
    with pytest.raises(WeightLoadError, match="outside the model folder"):
        LLMEngine(build_config(str(folder)))


def test_a_truncated_checkpoint_is_one_error_line_and_exit_2(tiny_model, tmp_path, capsys):
    from tritonserve.server.__main__ import main
    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)
    weights = next(folder.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
    assert main(["--model", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "not a readable safetensors file" in err
    assert "Traceback" not in err


# ---- tensor parallel: one batch's error is not the engine's death ---------------------------
@pytest.mark.slow
def test_a_tensor_parallel_engine_survives_a_failed_batch(tiny_model):
    from tritonserve.engine.sampler import Sampler
    engine = LLMEngine(build_config(tiny_model, dtype="float32", tensor_parallel_size=2))
    try:
        call, failed = Sampler.__call__, []

        def fail_once(self, *args, **kwargs):
            if not failed:
                failed.append(True)
                raise RuntimeError("a sampling fault")
            return call(self, *args, **kwargs)

        Sampler.__call__ = fail_once
        try:
            engine.add_request("x", SamplingParams(max_tokens=3), "first")
            steps = engine.step()  # rank 0's draw fails after the ranks met: this batch
            assert [s.completion.reason.value for s in steps] == ["error"]
            engine.add_request("y", SamplingParams(max_tokens=3), "second")
            done = []
            while engine.has_unfinished_requests():
                done += [s for s in engine.step() if s.finished]
            assert done[0].completion.reason.value == "length"
        finally:
            Sampler.__call__ = call
    finally:
        engine.close()


# ---- data parallel: a stuck engine costs only its own requests ------------------------------
def dp_front(model: str, **options):
    from tritonserve.server.dp_engine import DataParallelEngine
    server_keys = {"step_timeout"}
    engine = DataParallelEngine(build_config(model, dtype="float32", max_num_seqs=8, **{
        k: v for k, v in options.items() if k not in server_keys}), 2, "least-tokens")
    return engine, ServerThread(engine, **{k: v for k, v in options.items()
                                           if k in server_keys})


@pytest.mark.slow
def test_a_stopped_engine_with_a_large_message_freezes_nothing(tiny_model):
    """Engine 0 stopped (SIGSTOP), its pipe's buffer small: a request larger than the buffer
    routed to it blocked the front end's send under its lock, and with it the event loop
    (/health 169 s). Now /health answers, the other engine serves, and once engine 0 runs
    again its request completes: nothing lost."""
    engine, srv = dp_front(tiny_model, step_timeout=0)
    stopped = engine._engines[0]
    try:
        sock = socket.socket(fileno=os.dup(stopped.conn.fileno()))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        sock.close()
        os.kill(stopped.pid, signal.SIGSTOP)
        big, answer = send_in_background(srv.port, "/v1/completions", {  # both idle: engine 0
            "prompt": "x", "max_tokens": 64, "guided_choice": choices(2000)})
        while not engine.router.engines[0].requests:  # routed to it (and being sent)
            assert big.is_alive(), answer
            request(srv.port, "GET", "/health", timeout=15)
        assert request(srv.port, "GET", "/health", timeout=15)[0] == 200
        status, _, raw = request(srv.port, "POST", "/generate", {
            "prompt": "small", "max_tokens": 3, "stream": True}, timeout=30)
        assert status == 200 and validate_native(sse_payloads(raw))[-1].type == "done"
        assert big.is_alive()  # engine 0's request waits for engine 0 alone
        os.kill(stopped.pid, signal.SIGCONT)
        big.join(120)
        assert answer["status"] == 200, answer["raw"][:300]
        assert json.loads(answer["raw"])["choices"][0]["text"] in choices(2000)
    finally:
        os.kill(stopped.pid, signal.SIGCONT)
        srv.stop()


@pytest.mark.slow
def test_an_engine_compiling_a_grammar_is_not_a_stuck_step(tiny_model):
    """A data-parallel engine compiled the grammar again in add_request and said nothing: the
    watchdog (1 s here) took the compile for a stuck step and killed it. The engine now gets
    the parsed grammar, compiles it beside its loop and reports Alive meanwhile."""
    engine, srv = dp_front(tiny_model, step_timeout=1.0, max_grammar_chars=200_000)
    try:
        status, _, raw = request(srv.port, "POST", "/v1/completions", {
            "prompt": "x", "max_tokens": 64, "guided_choice": choices(5000)})
        assert status == 200, raw[:300]
        assert json.loads(raw)["choices"][0]["text"] in choices(5000)
        assert all(view.alive for view in engine.engines())
        assert request(srv.port, "GET", "/health")[0] == 200
    finally:
        srv.stop()


# ---- the bench's hostile-load check ---------------------------------------------------------
def test_bench_hostile_sends_every_body_and_reports_what_answered(server):
    """Structure, not speed: each hostile body gets its answer (the bounded ones a 400, the
    grammar that compiles and the streams a 200), the prober and the neighbour ran all the
    while, every probe answered 200, and each phase reports its neighbour against its
    baseline (the tool call against the ordinary stream of the same length)."""
    from tritonserve.bench.hostile import report, run
    result = run(server.url, quiet_rounds=1, tool_tokens=48, repeat=2, health_every=0.05)
    statuses = [a["status"] for a in result["answers"]]
    assert statuses == [400, 400, 200, 400, 400] * 2 + [200, 200], result["answers"]
    short = result["phases"][0]
    assert short["neighbour_streams"] == 10  # one beside each short body
    assert all(a["events"] > 1 for a in result["answers"][-2:])  # streamed
    assert result["probes"] > 0 and result["health_not_200"] == 0
    phases = {p["phase"]: p for p in result["phases"]}
    assert list(phases) == ["short bodies", "ordinary long stream", "tool call"]
    assert phases["short bodies"]["baseline_s"] == statistics.median(result["quiet_s"])
    ordinary = phases["ordinary long stream"]
    if ordinary["neighbour_streams"]:
        assert phases["tool call"]["baseline_s"] == ordinary["neighbour_median_s"]
    lines = report(result)
    assert lines[0].startswith("quiet neighbour") and lines[-1].startswith("/health over all")
    for phase in result["phases"]:  # a phase shorter than the probes' period has no p99
        phase["health_p99_ms"] = None
    assert "/health p99 - ms" in "\n".join(report(result))
