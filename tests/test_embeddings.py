"""Embeddings (engine/pooling.py): a prompt's final hidden states pooled (last token, mean,
cls) and normalised equal transformers' forward on the tiny model, under chunked prefill,
preemption and a warm prefix cache; the pooling is read from a sentence-transformers
checkpoint; /v1/embeddings through the `openai` SDK, float and base64, with `dimensions`
where the model allows, beside a generating stream."""
from __future__ import annotations

import json
import shutil
import threading

import pytest
import torch

from tritonserve.engine import LLM, InvalidRequestError, SamplingParams
from tritonserve.engine.pooling import resolve_pooling
from tests.test_engine_parity import mixed_prompts


def hf_embedding(model_dir: str, ids: list[int], kind: str, normalize: bool = True,
                 dimensions: int | None = None) -> torch.Tensor:
    import transformers
    model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0]
    vector = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[kind]
    vector = vector[:dimensions] if dimensions else vector
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


def _close(got, want, tol=1e-4):
    assert len(got) == len(want)
    assert torch.allclose(torch.tensor(got), want, atol=tol), (got[:4], want[:4])


@pytest.mark.parametrize("kind", ["last", "mean", "cls"])
def test_pooled_hidden_states_match_transformers(tiny_model, kind):
    llm = LLM(tiny_model, dtype="float32", pooling=kind, max_num_batched_tokens=32,
              num_blocks=14)
    prompts = [p[:60] for p in mixed_prompts(llm.tokenizer, count=6, seed=4)]
    prompts[0] = (prompts[0] * 6)[:100]  # chunked: 32 tokens a step
    vectors = llm.embed(prompts)
    for ids, vector in zip(prompts, vectors):
        _close(vector, hf_embedding(tiny_model, ids, kind))
    assert llm.engine.kv_cache.num_used_blocks == 0


def test_embeddings_beside_generation_and_the_prefix_cache(tiny_model):
    llm = LLM(tiny_model, dtype="float32")
    prompt = mixed_prompts(llm.tokenizer, count=1, seed=8, shared_prefix="a b c " * 12)[0]
    llm.generate([prompt], SamplingParams(max_tokens=2))  # the prefix cache holds it now
    outs = llm.generate([prompt, prompt], [SamplingParams(max_tokens=4, ignore_eos=True),
                                           SamplingParams(max_tokens=0, pooling="last")])
    assert len(outs[0].token_ids) == 4 and outs[1].token_ids == []
    assert outs[1].prompt_token_ids == prompt
    _close(llm.embed([prompt])[0], hf_embedding(tiny_model, prompt, "last"))
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(max_tokens=0, pooling="max")
    assert err.value.param == "pooling"


def _sentence_transformers(folder, kind: str, normalize: bool, matryoshka: bool) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models."
                "Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers."
                "models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    mode = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens",
            "cls": "pooling_mode_cls_token"}[kind]
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({mode: True}))
    if matryoshka:
        config = json.loads((folder / "config.json").read_text())
        config["is_matryoshka"] = True
        (folder / "config.json").write_text(json.dumps(config))


def test_pooling_is_read_from_the_checkpoint(tiny_model, tmp_path):
    assert resolve_pooling(None).kind == "last"
    folder = tmp_path / "st"
    shutil.copytree(tiny_model, folder)
    _sentence_transformers(folder, "mean", normalize=False, matryoshka=True)
    pooling = resolve_pooling(folder)
    assert (pooling.kind, pooling.normalize, pooling.matryoshka) == ("mean", False, True)
    assert "1_Pooling" in pooling.why
    assert resolve_pooling(folder, "cls").kind == "cls"


# ---- over HTTP ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def embedder(tiny_model, tmp_path_factory):
    """A Qwen3-Embedding-shaped folder: the tiny model with last-token pooling, normalised,
    Matryoshka dimensions allowed."""
    from tritonserve.engine import LLMEngine
    from tritonserve.engine.llm import build_config
    from tests.server_util import ServerThread
    folder = tmp_path_factory.mktemp("embedder") / "m"
    shutil.copytree(tiny_model, folder)
    _sentence_transformers(folder, "last", normalize=True, matryoshka=True)
    srv = ServerThread(LLMEngine(build_config(str(folder), dtype="float32")))
    yield srv, str(folder)
    srv.stop()


def test_openai_embeddings_float_and_base64(embedder):
    openai = pytest.importorskip("openai")
    srv, folder = embedder
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    texts = ["the quick brown fox", "paged attention", "café 😀"]
    encode = srv.engine.tokenizer.encode
    as_float = client.embeddings.create(model=srv.engine.model_name, input=texts,
                                        encoding_format="float")
    as_b64 = client.embeddings.create(model=srv.engine.model_name, input=texts)  # base64
    assert [d.index for d in as_float.data] == [0, 1, 2]
    assert as_float.usage.prompt_tokens == sum(len(encode(t)) for t in texts)
    for text, a, b in zip(texts, as_float.data, as_b64.data):
        want = hf_embedding(folder, encode(text), "last")
        _close(a.embedding, want)
        _close(b.embedding, want, tol=1e-6 + 1e-4)
    ids = encode("token ids in")
    short = client.embeddings.create(model=srv.engine.model_name, input=[ids], dimensions=8,
                                     encoding_format="float")
    _close(short.data[0].embedding, hf_embedding(folder, ids, "last", dimensions=8))


def test_embedding_errors_name_the_field(embedder, server):
    from tests.server_util import request
    srv, _ = embedder
    status, _, raw = request(srv.port, "POST", "/v1/embeddings", {"input": []})
    assert status == 400 and json.loads(raw)["error"]["param"] == "input"
    status, _, raw = request(srv.port, "POST", "/v1/embeddings", {"input": "x",
                                                                  "dimensions": 10 ** 6})
    assert status == 400 and json.loads(raw)["error"]["param"] == "dimensions"
    status, _, raw = request(server.port, "POST", "/v1/embeddings", {"input": "x",
                                                                     "dimensions": 4})
    assert status == 400 and "Matryoshka" in json.loads(raw)["error"]["message"]
    status, _, raw = request(srv.port, "POST", "/v1/embeddings", {"input": "x",
                                                                  "encoding_format": "hex"})
    assert status == 400 and json.loads(raw)["error"]["param"] == "encoding_format"


def test_embeddings_share_the_engine_with_a_stream(embedder):
    """A generating stream and embedding requests at once: both finish, the stream whole."""
    from tests.server_util import request, sse_payloads
    srv, _ = embedder
    results = {}

    def stream():
        status, _, raw = request(srv.port, "POST", "/generate", {
            "prompt": "hello", "max_tokens": 40, "ignore_eos": True, "stream": True})
        results["stream"] = (status, sse_payloads(raw))

    thread = threading.Thread(target=stream)
    thread.start()
    for _ in range(4):
        status, _, raw = request(srv.port, "POST", "/v1/embeddings", {
            "input": ["some words to embed"] * 8})
        assert status == 200 and len(json.loads(raw)["data"]) == 8
    thread.join(120)
    status, events = results["stream"]
    assert status == 200 and events[-1]["type"] == "done"
    assert events[-1]["output_tokens"] == 40 == len(events) - 1


def test_prompt_only_requests_take_their_share_of_a_step(tiny_model):
    """While a request decodes, embedding (and scoring) chunks take at most
    max_prompt_only_tokens of a step; alone, the whole budget."""
    from tritonserve.engine import LLMEngine
    from tritonserve.engine.llm import build_config
    from tests.test_long_prefill import spy_schedule
    engine = LLMEngine(build_config(tiny_model, max_prompt_only_tokens=32))
    chunks = spy_schedule(engine)
    ids = engine.tokenize("paged attention keeps keys and values in blocks " * 8)[:150]
    engine.add_request(ids, SamplingParams(max_tokens=0, pooling="last"), "alone")
    engine.step()  # nothing decodes: the whole prompt in one step
    assert chunks[-1] == [("alone", 150)] and not engine.has_unfinished_requests()
    engine.add_request(ids[:10], SamplingParams(max_tokens=30, ignore_eos=True), "stream")
    engine.step()  # its prefill; it decodes from now on
    chunks.clear()
    other = engine.tokenize("a prompt no cached block holds, for the share " * 12)[:150]
    engine.add_request(other, SamplingParams(max_tokens=0, pooling="last"), "embed")
    while engine.has_unfinished_requests():
        engine.step()
    embed = [n for step in chunks for rid, n in step if rid == "embed"]
    assert sum(embed) == 150 and max(embed) == 32, embed
    assert all(any(rid == "stream" for rid, _ in step) for step in chunks[:len(embed)])


def test_prompt_only_requests_take_their_share_of_the_time(tiny_model):
    """prompt_only_share 0.5: a step with embedding tokens comes only once the decode steps
    since the last one have taken as long as it did. Steps are given fixed costs here (4 with
    embedding tokens, 1 without), so the pattern is exact: four decode-only steps between
    two embedding steps; with share 1 (no time rule) none."""
    from tritonserve.engine import LLMEngine
    from tritonserve.engine.llm import build_config

    def pattern(share: float) -> str:
        engine = LLMEngine(build_config(tiny_model, max_prompt_only_tokens=16,
                                        prompt_only_share=share))
        scheduler, marks = engine.scheduler, []
        account = scheduler.account

        def fixed_cost(schedule, seconds):
            embeds = any(s.request.params.max_tokens == 0 for s in schedule.scheduled)
            marks.append("E" if embeds else "d")
            account(schedule, 4.0 if embeds else 1.0)

        scheduler.account = fixed_cost
        engine.add_request(engine.tokenize("a stream")[:4],
                           SamplingParams(max_tokens=40, ignore_eos=True), "stream")
        engine.step()  # its prefill: it decodes from now on
        marks.clear()
        other = engine.tokenize("a prompt no cached block holds, for the share " * 12)[:64]
        engine.add_request(other, SamplingParams(max_tokens=0, pooling="last"), "embed")
        while "embed" in engine._requests:
            engine.step()
        return "".join(marks)

    assert pattern(1.0) == "EEEE"  # 64 tokens, 16 a step, back to back
    assert pattern(0.5) == "E" + "ddddE" * 3
