"""LoRA adapters (engine/lora.py): tiny adapters made with `peft` (random non-zero B) on the
tiny model; greedy tokens equal to peft's merged model's for each, a mixed batch (base + two
adapters) equal to each request alone, over the dense and the int4 base; the layers op's
adapter rows within rounding of the op-by-op step's; prefix-cache blocks
kept apart per adapter; and the refusals that name the problem."""
from __future__ import annotations

import pytest
import torch

from tritonserve.engine import LLM, InvalidRequestError, SamplingParams
from tests.parity import assert_parity, hf_greedy
from tests.test_decode_layers import _compare_with_eager, needs_fp32_op, needs_op, op_models  # noqa: F401
from tests.test_engine_parity import mixed_prompts

peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: str, folder, seed: int, rank: int = 8, rslora: bool = False,
                 targets=TARGETS) -> tuple[str, str]:
    """-> (the adapter folder, a folder with peft's merged model)."""
    import transformers
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                             init_lora_weights=False, use_rslora=rslora)
    tuned = peft.get_peft_model(model, config)
    with torch.no_grad():  # B random and larger than peft's init, so outputs differ visibly
        for name, param in tuned.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.2)
    adapter = folder / f"adapter{seed}"
    tuned.save_pretrained(adapter)
    merged = folder / f"merged{seed}"
    tuned.merge_and_unload().save_pretrained(merged, safe_serialization=True)
    return str(adapter), str(merged)


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("loras")
    return [make_adapter(tiny_model, folder, seed, rank, rslora)
            for seed, rank, rslora in ((1, 8, False), (2, 16, True))]


def _modules(adapters) -> tuple[str, ...]:
    return tuple(f"a{i}={adapter}" for i, (adapter, _) in enumerate(adapters))


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_each_adapter_equals_peft_merged_and_a_mixed_batch_equals_alone(
        tiny_model, adapters, quantization):
    llm = LLM(tiny_model, dtype="float32", lora_modules=_modules(adapters),
              quantization=quantization)
    runner = llm.engine.runner
    took = _count_adapter_steps(runner)
    prompts = mixed_prompts(llm.tokenizer, count=3, seed=6)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    eos = set(llm.engine.eos_token_ids)
    alone = {}
    for i, (_, merged) in enumerate([(None, tiny_model)] + adapters):
        name = None if i == 0 else f"a{i - 1}"
        outs = llm.generate(prompts, greedy, lora=name)
        alone[name] = [o.token_ids for o in outs]
        if quantization == "none":
            refs = hf_greedy(merged, prompts, 12, eos)
            assert_parity(alone[name], refs)
    assert alone["a0"] != alone[None] and alone["a1"] != alone[None]
    # one batch: every prompt under the base and under each adapter, interleaved
    names = [None, "a0", "a1"] * len(prompts)
    mixed = llm.generate([p for p in prompts for _ in range(3)], greedy, lora=names)
    for k, out in enumerate(mixed):
        assert out.token_ids == alone[names[k]][k // 3], (k, names[k])
    if runner.plan.mode == "layers":  # adapters' decode steps kept the layers op
        assert took and runner.decode_takes_lora


def _count_adapter_steps(runner) -> list[int]:
    """The rows of each decode step with an adapter row that ran the runner's decode step."""
    took, step = [], runner.decode_step
    if step is not None:
        def counted(ids, positions, ctx):
            if ctx.lora is not None:
                took.append(ids.shape[0])
            return step(ids, positions, ctx)
        runner.decode_step = counted
    return took


@needs_fp32_op
@pytest.mark.parametrize("dtype,quantization,tolerance", [
    ("float32", "none", 1e-5), ("float32", "int4", 1e-5),
    pytest.param("bfloat16", "int4", 2e-2, marks=needs_op),
    pytest.param("bfloat16", "none", 2e-2, marks=needs_op)])
def test_the_layers_op_adds_each_rows_adapter_as_the_op_by_op_step_does(
        tiny_model, adapters, op_models, tmp_path, dtype, quantization, tolerance):
    """Decode steps of 6 rows down to 1 (base, a0 rank 8, a1 rank 16 rsLoRA, interleaved) over
    dense panels and quantized (int4) panels (bf16 dense: gate/up without silu in its matmul,
    as an engine serving adapters packs it): the layers op with the rows' adapter slots
    (kernels/cpu/lora_rows.h) gives the op-by-op step's hidden states within fp32 rounding
    (bf16, on a model of head size 64, which its attention takes: within a few bf16
    roundings, its products summed in another order before they round); without the slots
    it would be off by more than the hidden states' size."""
    model = tiny_model
    if dtype == "bfloat16":
        model = op_models["llama"]
        adapters = [make_adapter(model, tmp_path, seed, rank, rslora)
                    for seed, rank, rslora in ((1, 8, False), (2, 16, True))]
    llm = LLM(model, dtype=dtype, decode_mode="eager", max_num_seqs=8,
              lora_modules=_modules(adapters), quantization=quantization)
    steps = _compare_with_eager(llm)
    prompts = mixed_prompts(llm.tokenizer, count=6, seed=4)
    lengths = [3, 5, 8, 10, 12, 14]
    outs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n,
                                                 ignore_eos=True) for n in lengths],
                        lora=[None, "a0", "a1", "a0", None, "a1"])
    assert [len(o.token_ids) for o in outs] == lengths
    assert {6, 1} <= {n for n, _, _ in steps}
    assert max(gap for _, gap, _ in steps) < tolerance


def test_prefix_cache_blocks_are_kept_apart_per_adapter(tiny_model, adapters):
    llm = LLM(tiny_model, dtype="float32", lora_modules=_modules(adapters))
    prompt = mixed_prompts(llm.tokenizer, count=1, seed=9, shared_prefix="a b c d " * 12)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first = llm.generate([prompt], greedy, lora="a0")[0].token_ids
    stats = llm.engine.kv_cache.stats
    before = stats.hit_tokens
    base = llm.generate([prompt], greedy)[0].token_ids  # the base: no hit on a0's blocks
    assert stats.hit_tokens == before and base != first
    again = llm.generate([prompt], greedy, lora="a0")[0].token_ids  # a0 again: hits
    assert stats.hit_tokens > before and again == first


def test_refusals_name_the_problem(tiny_model, adapters, tmp_path):
    adapter, _ = adapters[1]  # rank 16
    with pytest.raises(InvalidRequestError, match="rank 16"):
        LLM(tiny_model, lora_modules=(f"big={adapter}",), max_lora_rank=8)
    with pytest.raises(InvalidRequestError, match="not a PEFT adapter"):
        LLM(tiny_model, lora_modules=(f"gone={tmp_path / 'nothing'}",))
    from tests.tiny_models import write_tiny_model
    other = write_tiny_model(tmp_path / "other", hidden_size=32, intermediate_size=64)
    with pytest.raises(InvalidRequestError, match="another base model"):
        LLM(str(other), lora_modules=(f"wrong={adapter}",))
    llm = LLM(tiny_model, lora_modules=_modules(adapters[:1]))
    with pytest.raises(InvalidRequestError) as err:
        llm.generate(["hi"], SamplingParams(max_tokens=2), lora="missing")
    assert err.value.param == "model"


def test_served_by_model_name(tiny_model, adapters):
    """A request names an adapter by `model`; /v1/models lists it with its base; streams of
    the base and of two adapters at once each get their own tokens."""
    import json
    import threading
    from tritonserve.engine import LLMEngine
    from tritonserve.engine.llm import build_config
    from tests.server_util import ServerThread, request, sse_payloads
    modules = _modules(adapters)
    srv = ServerThread(LLMEngine(build_config(tiny_model, dtype="float32",
                                              lora_modules=modules)))
    try:
        status, _, raw = request(srv.port, "GET", "/v1/models")
        listed = {m["id"]: m.get("parent") for m in json.loads(raw)["data"]}
        assert listed["a0"] == listed["a1"] == srv.engine.model_name
        reference = LLM(tiny_model, dtype="float32", lora_modules=modules)
        prompt = reference.tokenizer.encode("the quick brown fox")
        greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        want = {name: reference.generate([prompt], greedy, lora=name)[0].token_ids
                for name in (None, "a0", "a1")}
        got = {}

        def stream(name):
            body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                    "stream": True, "logprobs": 0}
            if name:
                body["model"] = name
            status, _, raw = request(srv.port, "POST", "/v1/completions", body)
            chunks = [c for c in sse_payloads(raw) if c != "[DONE]"]
            got[name] = [t for c in chunks for t in (c["choices"][0]["logprobs"] or {}).get(
                "tokens", [])]

        threads = [threading.Thread(target=stream, args=(n,)) for n in (None, "a0", "a1")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        piece = srv.engine.tokenizer.decode
        for name, ids in want.items():
            assert got[name] == [piece([i]) for i in ids], name
        status, _, raw = request(srv.port, "POST", "/v1/chat/completions", {
            "model": "a1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert status == 200, raw
        status, _, raw = request(srv.port, "POST", "/v1/completions", {
            "model": "a9", "prompt": "hi", "max_tokens": 2})
        assert status == 404 and "a0" in json.loads(raw)["error"]["message"]
    finally:
        srv.stop()


def test_load_serve_unload_load_again_with_streams_running(tiny_model, adapters):
    import json
    import threading
    from tritonserve.engine import LLMEngine
    from tritonserve.engine.llm import build_config
    from tests.server_util import ServerThread, request, sse_payloads
    adapter, _ = adapters[0]
    srv = ServerThread(LLMEngine(build_config(tiny_model, dtype="float32")),
                       allow_runtime_lora=True)
    off = ServerThread(LLMEngine(build_config(tiny_model, dtype="float32")))
    try:
        status, _, _ = request(off.port, "POST", "/v1/load_lora_adapter",
                               {"lora_name": "x", "lora_path": adapter})
        assert status == 403
        reference = LLM(tiny_model, dtype="float32", lora_modules=(f"x={adapter}",))
        prompt = reference.tokenizer.encode("hello world")
        greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        want = reference.generate([prompt], greedy, lora="x")[0].token_ids
        ends = {}

        def stream(name, model, tokens):
            body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            if model:
                body["model"] = model
            status, _, raw = request(srv.port, "POST", "/v1/completions", body)
            ends[name] = (status, sse_payloads(raw))

        base = threading.Thread(target=stream, args=("base", None, 200))
        base.start()  # a base stream runs throughout
        status, _, raw = request(srv.port, "POST", "/v1/load_lora_adapter",
                                 {"lora_name": "x", "lora_path": adapter})
        assert status == 200, raw
        status, _, raw = request(srv.port, "POST", "/v1/completions", {
            "model": "x", "prompt": prompt, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "logprobs": 0})
        tokens = json.loads(raw)["choices"][0]["logprobs"]["tokens"]
        assert tokens == [srv.engine.tokenizer.decode([t]) for t in want]
        busy = threading.Thread(target=stream, args=("x", "x", 150))
        busy.start()
        for _ in range(200):  # until the adapter's stream is running
            if srv.engine.lora_users("x"):
                break
            threading.Event().wait(0.02)
        status, _, raw = request(srv.port, "POST", "/v1/unload_lora_adapter",
                                 {"lora_name": "x"})
        assert status == 400 and "in use" in json.loads(raw)["error"]["message"]
        busy.join(120)
        status, _, raw = request(srv.port, "POST", "/v1/unload_lora_adapter",
                                 {"lora_name": "x"})
        assert status == 200, raw
        status, _, raw = request(srv.port, "POST", "/v1/completions", {
            "model": "x", "prompt": "hi", "max_tokens": 2})
        assert status == 404
        status, _, raw = request(srv.port, "POST", "/v1/load_lora_adapter",
                                 {"lora_name": "x", "lora_path": adapter})
        assert status == 200, raw
        base.join(120)
        for name in ("base", "x"):
            status, chunks = ends[name]
            assert status == 200 and chunks[-1] == "[DONE]"
            assert chunks[-2]["choices"][0]["finish_reason"] == "length", name
            assert not any("error" in c for c in chunks if c != "[DONE]")
    finally:
        srv.stop()
        off.stop()


def test_speculation_and_a_grammar_keep_working_under_an_adapter(tiny_model, adapters):
    from tests.test_speculative import REPEATS, SPEC
    modules = _modules(adapters)
    plain = LLM(tiny_model, dtype="float32", lora_modules=modules)
    spec = LLM(tiny_model, dtype="float32", lora_modules=modules, **SPEC)
    prompts = [plain.tokenizer.encode(p) for p in REPEATS]
    prompt = prompts[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for name in ("a0", "a1"):
        want = [o.token_ids for o in plain.generate(prompts, greedy, lora=name)]
        assert [o.token_ids for o in spec.generate(prompts, greedy, lora=name)] == want
    assert spec.engine.spec_stats.proposed > 0  # it did speculate
    from tritonserve.engine.structured import StructuredOutput
    choice = SamplingParams(temperature=0.0, max_tokens=20, structured=StructuredOutput(
        "choice", '["alpha", "beta"]', "guided_choice"))
    text = plain.generate([prompt], choice, lora="a1")[0].text
    assert text in ("alpha", "beta")


def test_a_gguf_lora_file_equals_its_peft_folder(tiny_model, adapters, tmp_path):
    """Adapter a0 (rank 8, alpha 16; not rsLoRA, which llama.cpp's file cannot say) written as
    llama.cpp's convert_lora_to_gguf.py writes it (q / k B rows permuted for the llama
    converter): in F32 its parts are the PEFT folder's exactly and its greedy tokens the
    folder's; F16 and Q8_0 files read within their rounding; a base model's GGUF given as an
    adapter is refused naming why."""
    from pathlib import Path
    from tritonserve.engine.lora import load_adapter
    from tests.gguf_files import write_gguf, write_gguf_lora
    folder, _ = adapters[0]
    f32 = write_gguf_lora(Path(folder), Path(tiny_model), tmp_path / "a0.gguf")
    llm = LLM(tiny_model, dtype="float32", lora_modules=(f"peft={folder}", f"gguf={f32}"))
    peft_parts, gguf_parts = (llm.engine.loras[n].parts for n in ("peft", "gguf"))
    assert peft_parts.keys() == gguf_parts.keys() and len(peft_parts) == 4 * 2  # tiny: 2 layers
    for key, parts in peft_parts.items():
        for p, g in zip(parts, gguf_parts[key], strict=True):
            assert torch.equal(p.a, g.a) and torch.equal(p.b, g.b) and p.offset == g.offset
    prompts = mixed_prompts(llm.tokenizer, count=3, seed=6)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = {name: [o.token_ids for o in llm.generate(prompts, greedy, lora=name)]
              for name in ("peft", "gguf", None)}
    assert tokens["gguf"] == tokens["peft"] != tokens[None]
    arch = llm.engine.arch
    for outtype, tol in (("f16", 1e-3), ("q8_0", 1e-2)):
        loaded = load_adapter("x", write_gguf_lora(Path(folder), Path(tiny_model),
                                                   tmp_path / f"a0-{outtype}.gguf", outtype), arch)
        for key, parts in peft_parts.items():
            for p, g in zip(parts, loaded.parts[key], strict=True):
                for want, got in ((p.a, g.a), (p.b, g.b)):
                    assert (want - got).abs().max() <= tol * want.abs().max(), (outtype, key)
    base = write_gguf(Path(tiny_model), tmp_path / "base.gguf")
    with pytest.raises(InvalidRequestError, match="not a LoRA adapter"):
        load_adapter("base", base, arch)


@needs_op
def test_a_bf16_engine_on_gguf_blocks_adds_adapters_on_its_dense_twin(op_models, tmp_path):
    """A bf16 engine on GGUF blocks runs steps past 8 rows on a dense twin (bf16 panels). An
    engine that serves adapters packs every gate/up without silu in its matmul, so the twin
    takes adapter rows too: prefill chunks and 16-row decode steps with an adapter run on it
    (the layers op for decode), the adapter's streams end whole and differ from the base's."""
    from pathlib import Path
    from tests.gguf_files import write_gguf
    model = op_models["llama"]
    adapter, _ = make_adapter(model, tmp_path, 3, 8)
    blocks = write_gguf(Path(model), tmp_path / "q8.gguf", quantized=True)
    llm = LLM(str(blocks), dtype="bfloat16", quantization="gguf", lora_modules=(f"a={adapter}",))
    runner = llm.engine.runner
    assert runner.weights.dense is not None and runner.dense_takes_lora
    assert not any(layer.mlp.silu_in_matmul for layer in runner.weights.dense.layers)
    ran = []  # (rows, an adapter row in the step, the weights that ran: twin or blocks)

    def spy(forward, which):
        def spied(ids, positions, ctx):
            ran.append((ids.shape[0], ctx.lora is not None, which))
            return forward(ids, positions, ctx)
        return spied
    runner.model.forward = spy(runner.model.forward, "blocks")
    runner.weights.dense.forward = spy(runner.weights.dense.forward, "twin")
    if runner.decode_step is not None:  # the layers op on each
        runner.decode_step = spy(runner.decode_step, "blocks")
        runner.dense_decode_step = spy(runner.dense_decode_step, "twin")
    prompts = mixed_prompts(llm.tokenizer, count=16, seed=5)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    base = [o.token_ids for o in llm.generate(prompts, greedy)]
    adapted = llm.generate(prompts, greedy, lora="a")
    assert all(o.finish_reason == "length" and len(o.token_ids) == 6 for o in adapted)
    assert [o.token_ids for o in adapted] != base
    assert {w for rows, lora, w in ran if lora and rows > 8} == {"twin"}
    assert {w for rows, lora, w in ran if lora and rows <= 8} <= {"blocks"}


def test_max_loras_caps_the_adapters_a_step_holds(tiny_model, adapters):
    """max_loras 1 with requests of the base and of two adapters interleaved: no step holds
    more than one adapter, a1's requests start once a0's have all ended, the base's requests
    are never held back by it, and each request gets its uncapped tokens."""
    names = [None, "a0", "a1"] * 2
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    free = LLM(tiny_model, dtype="float32", lora_modules=_modules(adapters))
    prompts = mixed_prompts(free.tokenizer, count=len(names), seed=8)
    want = [o.token_ids for o in free.generate(prompts, greedy, lora=names)]
    llm = LLM(tiny_model, dtype="float32", lora_modules=_modules(adapters), max_loras=1)
    scheduler, steps = llm.engine.scheduler, []
    schedule = scheduler.schedule

    def spied():
        out = schedule()
        steps.append({s.request.request_id: s.request.lora.name if s.request.lora else None
                      for s in out.scheduled})
        return out
    scheduler.schedule = spied
    assert [o.token_ids for o in llm.generate(prompts, greedy, lora=names)] == want
    held = [set(step.values()) - {None} for step in steps if step]
    assert all(len(h) <= 1 for h in held)
    assert {"a0"} in held and {"a1"} in held
    assert {"a0"} not in held[held.index({"a1"}):]  # a1 waited for a0's requests to end
    base = {rid for step in steps for rid, name in step.items() if name is None}
    for rid in base:  # every step from its first to its last: never held back
        at = [i for i, step in enumerate(steps) if rid in step]
        assert at == list(range(at[0], at[0] + len(at))), rid
    with pytest.raises(ValueError, match="max_loras"):
        LLM(tiny_model, max_loras=0)


@pytest.mark.slow
def test_the_triton_path_adds_every_rows_adapter_through_the_kernels(tiny_model, adapters):
    """attention_backend triton (interpreted here): a step's adapters stacked by slot
    (engine/lora.py's LoraStack) and added by kernels/triton/lora.py's shrink and expand, one
    launch a part for every row (decode steps), or the segmented form a tile of a run's rows
    (the prefill, whose long prompt's run is past SGMV_MIN_ROWS); a batch of base, a0 and a1
    rows gives the torch path's tokens, which differ between the adapters."""
    from tritonserve.engine import lora
    from tritonserve.kernels.triton import lora as kernels

    modules = _modules(adapters)
    prompts = ["Hello world", "Stop strings like ### or END may span several tokens. " * 2]
    names = [None, "a0", "a1", "a1"]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    batch = [prompts[i % 2] for i in range(4)]
    want = LLM(tiny_model, dtype="float32", lora_modules=modules,
               attention_backend="torch").generate(batch, params, lora=names)
    llm = LLM(tiny_model, dtype="float32", lora_modules=modules, attention_backend="triton")
    calls, segmented = [], []
    shrink, sgmv = kernels.lora_shrink, kernels.sgmv_shrink

    def counted(x, a, slots, *args):
        calls.append(slots.tolist())
        return shrink(x, a, slots, *args)

    def counted_sgmv(x, a, tiles, *args):
        segmented.append(tiles.tolist())
        return sgmv(x, a, tiles, *args)

    kernels.lora_shrink, kernels.sgmv_shrink = counted, counted_sgmv
    try:
        got = llm.generate(batch, params, lora=names)
    finally:
        kernels.lora_shrink, kernels.sgmv_shrink = shrink, sgmv
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    long_rows = len(llm.tokenizer.encode(prompts[1]))
    assert long_rows >= kernels.SGMV_BLOCK_M + 2  # a run of two tiles, the second partial
    # the prefill: the adapter requests' rows (a0: the long prompt; a1: both) in tiles of at
    # most 16 rows of one run, none shared; the base request's rows in none
    lengths = [len(llm.tokenizer.encode(batch[i])) for i in range(4)]
    (tiles,) = segmented[:1]
    covered = [r for first, count, _ in tiles for r in range(first, first + count)]
    assert len(covered) == len(set(covered)) == sum(lengths[1:])
    assert all(0 < count <= kernels.SGMV_BLOCK_M and slot >= 0 for _, count, slot in tiles)
    assert sorted(count for _, count, _ in tiles).count(kernels.SGMV_BLOCK_M) >= 2
    # the same prompt: base vs a1 (rows 0, 2), a0 vs a1 (rows 1, 3)
    assert want[0].token_ids != want[2].token_ids and want[1].token_ids != want[3].token_ids
    assert any(-1 in c and 0 in c and 1 in c for c in calls)  # mixed rows in one launch
    assert lora.LoraStack._made
