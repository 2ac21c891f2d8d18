"""The families past Llama's (Gemma 2 / 3, Phi-3, Granite, OLMo 2, SmolLM3), each a tiny
random checkpoint made by transformers (tests/tiny_models.py: FAMILY_SHAPES sets every field
the family differs in, windows shorter than the prompts): our greedy tokens identical to
transformers' in fp32 for 32 tokens, each sampled token's logprob within tolerance of
transformers' log-softmax, the chat template applied; and the rope kinds (yarn, longrope,
dynamic, partial rotary) against transformers' own tables and generate."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from tritonserve.engine import LLM, SamplingParams
from tritonserve.engine.models import ModelArch
from tritonserve.engine.models.rope import rope_tables
from tests.parity import assert_parity, hf_greedy
from tests.tiny_models import FAMILY_SHAPES, write_tiny_model

FAMILIES = ["Gemma3ForCausalLM", "Gemma2ForCausalLM", "Phi3ForCausalLM", "GraniteForCausalLM",
            "Olmo2ForCausalLM", "SmolLM3ForCausalLM"]
# per step, |our logprob - transformers'| of the sampled token (fp32, different op order)
LOGPROB_TOL = 2e-3


def prompts_for(tokenizer, seed=0) -> list[list[int]]:
    """Prompts of 2 to ~120 tokens: past the tiny Gemmas' window of 8 and inside it."""
    rng = random.Random(seed)
    words = ("paged attention block token stream the quick brown fox schedule cache "
             "hello world emoji café").split()
    return [tokenizer.encode(" ".join(rng.choice(words) for _ in range(n)))
            for n in (1, 3, 8, 20, 40)]


def hf_logprobs(folder: str, prompt: list[int], tokens: list[int]) -> list[float]:
    """transformers' log-softmax of each of `tokens` after prompt + the tokens before it."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return logprobs[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()


@pytest.fixture(scope="module")
def family_models(tmp_path_factory) -> dict[str, str]:
    return {arch: str(write_tiny_model(tmp_path_factory.mktemp(arch), arch))
            for arch in FAMILIES}


@pytest.mark.parametrize("arch", FAMILIES)
def test_greedy_tokens_and_logprobs_equal_transformers(family_models, arch):
    llm = assert_greedy_parity(family_models[arch])
    # the chat template is the checkpoint's, applied
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hello"}],
                                             tokenize=False, add_generation_prompt=True)
    assert text.endswith("assistant\n") and "hello" in text


def assert_greedy_parity(folder: str) -> LLM:
    """fp32 eager: greedy tokens for 32 steps equal to transformers' (tie rule of
    tests/parity.py), the longest prompt's logprobs within LOGPROB_TOL; returns the LLM."""
    llm = LLM(folder, dtype="float32", decode_mode="eager")
    prompts = prompts_for(llm.tokenizer)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, logprobs=0))
    refs = hf_greedy(folder, prompts, 32, set(llm.engine.eos_token_ids))
    assert_parity([o.token_ids for o in outs], refs)
    longest = prompts.index(max(prompts, key=len))
    out = outs[longest]
    ours = [t.logprob for t in out.logprobs]
    theirs = hf_logprobs(folder, prompts[longest], out.token_ids)
    assert max(abs(a - b) for a, b in zip(ours, theirs)) < LOGPROB_TOL
    return llm


@pytest.mark.parametrize("arch", FAMILIES)
def test_bfloat16_stays_near_transformers_fp32(family_models, arch):
    """The path a user on this CPU gets (bf16, the compiled step): each greedy token's logprob
    within bf16's rounding of transformers' fp32 log-softmax (0.01-0.07 measured; a wrong norm
    or rope is whole units off)."""
    folder = family_models[arch]
    llm = LLM(folder, dtype="bfloat16")
    prompt = prompts_for(llm.tokenizer)[-1]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, logprobs=0))[0]
    theirs = hf_logprobs(folder, prompt, out.token_ids)
    assert max(abs(t.logprob - b) for t, b in zip(out.logprobs, theirs)) < 0.25


def test_each_family_names_its_plan_and_why(family_models):
    """The start-up line's plan: layers where the C++ op takes the layer, else the path that
    runs instead and what the op does not take."""
    why = {arch: LLM(folder, dtype="float32").engine.runner.plan.why_mode
           for arch, folder in family_models.items()
           if arch in ("Gemma3ForCausalLM", "Olmo2ForCausalLM", "SmolLM3ForCausalLM")}
    assert why["Gemma3ForCausalLM"] == (
        "auto; layers does not take Gemma3ForCausalLM in float32: sandwich norms, gelu_tanh "
        "activation, q/k norms, a rope table per layer, an embedding scale")
    assert "post norms, q/k norms" in why["Olmo2ForCausalLM"]
    assert "layers without rope" in why["SmolLM3ForCausalLM"]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["Gemma3ForCausalLM", "Gemma2ForCausalLM"])
def test_the_compiled_step_takes_windows_and_softcaps(family_models, arch):
    """The compiled decode graph calls the C++ op with each layer's window and soft-cap (no
    host read of the lengths): its tokens are eager's, past the window of 8."""
    tokens = {}
    for mode in ("eager", "compile"):
        llm = LLM(family_models[arch], dtype="float32", decode_mode=mode)
        outs = llm.generate(prompts_for(llm.tokenizer),
                            SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
        tokens[mode] = [o.token_ids for o in outs]
    assert tokens["compile"] == tokens["eager"]


def test_gemma3_variant_reads_both_config_shapes():
    """config.json as Google ships Gemma 3 (rope_theta, rope_local_base_freq, rope_scaling,
    sliding_window_pattern) and as transformers 5 writes it (layer_types, a rope per kind of
    layer) give the same variant."""
    base = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
            "vocab_size": 10, "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 7, "num_attention_heads": 2, "head_dim": 8,
            "query_pre_attn_scalar": 8, "sliding_window": 4}
    shipped = ModelArch.from_dict({**base, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                                   "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                                   "sliding_window_pattern": 6}).variant
    kinds = ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    written = ModelArch.from_dict({**base, "layer_types": kinds, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}).variant
    for variant in (shipped, written):
        assert variant.windows == (4, 4, 4, 4, 4, None, 4)
        assert variant.layer_ropes == (1, 1, 1, 1, 1, 0, 1)
        assert (variant.ropes[0].theta, variant.ropes[0].kind) == (1e6, "linear")
        assert (variant.ropes[1].theta, variant.ropes[1].kind) == (1e4, "default")
        assert variant.tied_head and variant.norm_offset == 1.0
        assert variant.attention_scale == 8 ** -0.5 and variant.embedding_scale == 4.0
    assert shipped.ropes[0].params == written.ropes[0].params


ROPES = {
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
                    "mscale": 0.9, "mscale_all_dim": 0.7, "beta_fast": 16, "beta_slow": 2},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 64,
                 "short_factor": [1.0 + 0.1 * i for i in range(8)],
                 "long_factor": [2.0 + 0.5 * i for i in range(8)]},
}


@pytest.mark.parametrize("name", sorted(ROPES))
def test_rope_tables_equal_transformers_inv_freq(name):
    """Our inverse frequencies and attention factor (read back from the tables) against
    transformers' ROPE_INIT_FUNCTIONS, inside and past the original context."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    params = dict(ROPES[name])
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4,
                                      max_position_embeddings=256,
                                      rope_parameters={**params, "rope_theta": 10000.0})
    arch = ModelArch.from_dict({**config.to_dict(), "architectures": ["LlamaForCausalLM"]})
    rope = arch.variant.ropes[0]
    cos, sin = rope_tables(rope, arch.head_dim, 256)
    kind = params["rope_type"]
    original = params.get("original_max_position_embeddings", 256)
    for position in (1, 5, original - 1, original + 3, 200):
        inv_freq, factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu", seq_len=position + 1) \
            if kind in ("longrope", "dynamic") else ROPE_INIT_FUNCTIONS[kind](config, "cpu")
        if kind == "dynamic" and position >= original:
            continue  # transformers grows the base by the sequence's length; ours per position
        angle = position * inv_freq.float()
        expected = torch.cat((angle, angle)).cos() * factor
        assert torch.allclose(cos[position], expected, atol=1e-5), (name, position)


@pytest.mark.parametrize("arch, rope", [
    ("Qwen2ForCausalLM", {"rope_type": "yarn", "factor": 4.0,
                          "original_max_position_embeddings": 64}),
    ("Phi3ForCausalLM", {"rope_type": "longrope", "original_max_position_embeddings": 256,
                         "short_factor": [1.0 + 0.1 * i for i in range(4)],
                         "long_factor": [3.0] * 4}),
    ("LlamaForCausalLM", {"rope_type": "dynamic", "factor": 2.0})])
def test_rope_kinds_greedy_equal_transformers(tmp_path, arch, rope):
    """yarn, longrope (Phi-3's, with partial rotary: 4 frequencies of a 16-wide head) and
    dynamic NTK through the engine, against generate: sequences inside the original context
    (past it, transformers re-rotates the whole sequence by its length; a cache cannot)."""
    folder = str(write_tiny_model(tmp_path / arch, arch,
                                  rope_parameters={**rope, "rope_theta": 10000.0}))
    llm = LLM(folder, dtype="float32", decode_mode="eager")
    prompts = prompts_for(llm.tokenizer, seed=4)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24))
    refs = hf_greedy(folder, prompts, 24, set(llm.engine.eos_token_ids))
    assert_parity([o.token_ids for o in outs], refs)


def test_windows_stay_exact_under_prefix_caching_and_chunked_prefill(tmp_path):
    """A Mistral whose window (16) is shorter than its prompts, and the tiny Gemma 3 (local
    and global layers): greedy equal to transformers with a shared prefix served from the
    prefix cache and prompts prefilled in chunks of 8 (a chunk's queries see keys from
    earlier chunks inside the window only)."""
    mistral = str(write_tiny_model(tmp_path / "mistral", "MistralForCausalLM",
                                   sliding_window=16))
    gemma = str(write_tiny_model(tmp_path / "gemma3", "Gemma3ForCausalLM"))
    for folder in (mistral, gemma):
        llm = LLM(folder, dtype="float32", max_num_batched_tokens=8)
        shared = "the quick brown fox schedule cache paged attention block token " * 3
        prompts = [llm.tokenizer.encode(shared + tail)
                   for tail in ("hello", "world emoji", "stream café fox")]
        first = llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=20))
        rest = llm.generate(prompts[1:], SamplingParams(temperature=0.0, max_tokens=20))
        assert llm.engine.kv_cache.stats.hit_tokens >= 16
        refs = hf_greedy(folder, prompts, 20, set(llm.engine.eos_token_ids))
        assert_parity([o.token_ids for o in first + rest], refs)


GGUF_FAMILIES = ["Gemma3ForCausalLM", "Gemma2ForCausalLM", "Phi3ForCausalLM",
                 "GraniteForCausalLM", "Olmo2ForCausalLM", "SmolLM3ForCausalLM"]
# what a GGUF file cannot say and llama.cpp assumes: Gemma's q.k scale is the head size's,
# SmolLM3's NoPE layers every fourth
GGUF_OVERRIDES = {"SmolLM3ForCausalLM": dict(no_rope_layer_interval=4, num_hidden_layers=4),
                  "Gemma3ForCausalLM": dict(query_pre_attn_scalar=16),
                  "Gemma2ForCausalLM": dict(query_pre_attn_scalar=16),
                  "Phi3ForCausalLM": dict(rope_parameters={
                      "rope_type": "longrope", "rope_theta": 10000.0,
                      "original_max_position_embeddings": 256, "partial_rotary_factor": 0.5,
                      "short_factor": [1.0 + 0.1 * i for i in range(4)],
                      "long_factor": [3.0] * 4})}


@pytest.mark.parametrize("arch", GGUF_FAMILIES)
def test_the_family_as_a_gguf_file_gives_transformers_tokens(tmp_path, arch):
    """The checkpoint written as llama.cpp's converter writes it (tests/gguf_files.py): in
    F32, converted back (config from the file's keys, names, the converter's transforms
    undone), greedy equal to transformers on the original folder; in Q8_0 blocks served as
    blocks, equal to transformers on the blocks' dequantized weights (the converted
    folder), with the chat template carried over."""
    from tests.gguf_files import write_gguf
    from tritonserve.engine.default_model import gguf_folder

    folder = write_tiny_model(tmp_path / "hf", arch, **GGUF_OVERRIDES.get(arch, {}))
    dense = write_gguf(folder, tmp_path / "f32.gguf")
    llm = LLM(str(dense), dtype="float32", decode_mode="eager")
    prompts = prompts_for(llm.tokenizer, seed=1)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32))
    refs = hf_greedy(str(folder), prompts, 32, set(llm.engine.eos_token_ids))
    assert_parity([o.token_ids for o in outs], refs)
    ours, theirs = llm.engine.arch.variant, ModelArch.from_folder(folder).variant
    fields = [f.name for f in dataclasses.fields(ours)
              if f.name not in ("ropes", "attention_scale", "residual_scale")]
    assert [getattr(ours, f) for f in fields] == [getattr(theirs, f) for f in fields]
    assert ours.attention_scale == pytest.approx(theirs.attention_scale)
    assert ours.residual_scale == pytest.approx(theirs.residual_scale)
    for a, b in zip(ours.ropes, theirs.ropes):  # the file holds fp32 scalars
        assert torch.allclose(rope_tables(a, 16, 512)[0], rope_tables(b, 16, 512)[0])

    blocks = write_gguf(folder, tmp_path / "q8.gguf", quantized=True)
    llm = LLM(str(blocks), dtype="float32", decode_mode="eager", quantization="gguf")
    assert llm.engine.runner.plan.weights == "gguf"
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32))
    refs = hf_greedy(str(gguf_folder(blocks)), prompts, 32, set(llm.engine.eos_token_ids))
    assert_parity([o.token_ids for o in outs], refs)
    assert "hello" in llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True)


def test_the_text_tower_of_a_gemma3_multimodal_checkpoint(tmp_path):
    """Gemma3ForConditionalGeneration (a vision tower beside the text model, the text config
    nested, tensors under language_model.): served as its text tower, transformers' tokens."""
    import transformers

    from tests.tiny_models import write_tokenizer
    vocab = write_tokenizer(tmp_path)
    shape = {k: v for k, v in FAMILY_SHAPES["Gemma3ForCausalLM"].items()
             if k != "tie_word_embeddings"}
    text = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2,
                eos_token_id=2, bos_token_id=1, pad_token_id=0, **shape)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision,
                                       mm_tokens_per_image=4, image_token_index=vocab - 1,
                                       boi_token_index=vocab - 2, eoi_token_index=vocab - 3)
    config.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(0)
    transformers.Gemma3ForConditionalGeneration(config).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", decode_mode="eager")
    prompts = prompts_for(llm.tokenizer)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32))
    refs = hf_greedy(str(tmp_path), prompts, 32, set(llm.engine.eos_token_ids))
    assert_parity([o.token_ids for o in outs], refs)
