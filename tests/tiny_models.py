"""Tiny random Llama-family models and a BPE tokenizer trained on the fly, written to folders."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "A scheduler batches many requests and streams every token as soon as it is sampled.",
    "Hello world! Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
    "Emoji and other scripts: 😀 🚀 🎉 ❤️ café naïve 你好世界 日本語のテキスト 한국어 Привет мир.",
    "def main():\n    print('hello')\n    return 0\n",
    "Stop strings like ### or END may span several tokens.",
] * 20

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                 "{{ message['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tokenizer(folder: Path, vocab_size: int = 384, metaspace: bool = False,
                    special: tuple[str, ...] = ()) -> int:
    """Byte-level BPE (GPT-2, Llama 3, SmolLM2 style), or with metaspace=True SentencePiece
    style (Llama 2, Mistral): words marked by a leading "▁", the first one's stripped when
    decoding. `special`: more special tokens (after SPECIAL_TOKENS, whose ids stay)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if metaspace:
        tokenizer = Tokenizer(models.BPE(unk_token="<|endoftext|>"))
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tokenizer.decoder = decoders.Metaspace(prepend_scheme="first")
        alphabet = sorted(set("".join(CORPUS)))
    else:
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size,
                                  special_tokens=SPECIAL_TOKENS + list(special),
                                  initial_alphabet=alphabet)
    tokenizer.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", unk_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return tokenizer.get_vocab_size()


# Each family's own fields, small enough for the tiny model and set so that every way it
# differs from Llama is exercised: Gemma's windows shorter than the test prompts (a 6-layer
# Gemma 3 has a global layer among five local ones), soft-caps near the scores' range,
# Phi-3's partial rotary, Granite's multipliers away from 1, SmolLM3's NoPE layer.
FAMILY_SHAPES: dict[str, dict] = {
    "Qwen3ForCausalLM": dict(head_dim=16),
    "Gemma2ForCausalLM": dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
                              attn_logit_softcapping=3.0, final_logit_softcapping=5.0,
                              num_hidden_layers=3, tie_word_embeddings=True),
    "Gemma3ForCausalLM": dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
                              num_hidden_layers=6, tie_word_embeddings=True, rope_parameters={
                                  "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                     "rope_theta": 1e6},
                                  "sliding_attention": {"rope_type": "default",
                                                        "rope_theta": 1e4}}),
    "Phi3ForCausalLM": dict(partial_rotary_factor=0.5),
    "GraniteForCausalLM": dict(embedding_multiplier=6.0, residual_multiplier=0.3,
                               attention_multiplier=0.2, logits_scaling=2.5),
    "Olmo2ForCausalLM": dict(),
    "SmolLM3ForCausalLM": dict(no_rope_layer_interval=2, tie_word_embeddings=True),
    # mixtures of experts: 8 experts, top 2 or 3, the second layer's experts used
    # (Qwen3-MoE: a dense first layer, mlp_only_layers)
    "Qwen3MoeForCausalLM": dict(head_dim=16, num_experts=8, num_experts_per_tok=3,
                                moe_intermediate_size=32, norm_topk_prob=True,
                                num_hidden_layers=3, mlp_only_layers=[0]),
    "MixtralForCausalLM": dict(num_local_experts=4, num_experts_per_tok=2,
                               intermediate_size=64),
    "OlmoeForCausalLM": dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32),
    # gpt-oss: sliding (8 tokens) and full layers alternating, attention sinks, YaRN, biased
    # router and experts, the clamped SwiGLU (a limit the random weights reach)
    "GptOssForCausalLM": dict(head_dim=16, num_local_experts=8, num_experts_per_tok=2,
                              intermediate_size=32, num_hidden_layers=4, sliding_window=8,
                              swiglu_limit=1.0, rope_parameters={
                                  "rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                  "beta_slow": 1.0, "truncate": False, "rope_theta": 1e4,
                                  "original_max_position_embeddings": 128}),
}


def write_tiny_model(folder: Path, architecture: str = "LlamaForCausalLM", seed: int = 0,
                     metaspace: bool = False, special: tuple[str, ...] = (),
                     **overrides) -> Path:
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(folder, metaspace=metaspace, special=special)
    eos = SPECIAL_TOKENS.index("<|im_end|>")
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, initializer_range=0.2, tie_word_embeddings=False,
                  eos_token_id=eos, bos_token_id=1, pad_token_id=0)
    family = {
        "LlamaForCausalLM": transformers.LlamaConfig,
        "MistralForCausalLM": transformers.MistralConfig,
        "Qwen2ForCausalLM": transformers.Qwen2Config,
        "Qwen3ForCausalLM": transformers.Qwen3Config,
        "Gemma2ForCausalLM": transformers.Gemma2Config,
        "Gemma3ForCausalLM": transformers.Gemma3TextConfig,
        "Phi3ForCausalLM": transformers.Phi3Config,
        "GraniteForCausalLM": transformers.GraniteConfig,
        "Olmo2ForCausalLM": transformers.Olmo2Config,
        "SmolLM3ForCausalLM": transformers.SmolLM3Config,
        "Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig,
        "MixtralForCausalLM": transformers.MixtralConfig,
        "OlmoeForCausalLM": transformers.OlmoeConfig,
        "GptOssForCausalLM": transformers.GptOssConfig,
    }[architecture]
    common.update(FAMILY_SHAPES.get(architecture, {}))
    common.update(overrides)
    config = family(**common)
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).eval()
    with torch.no_grad():  # transformers starts biases at zero: random ones are tested
        for name, param in model.named_parameters():
            if name.endswith(("bias", "_bias")):
                param.normal_(0.0, 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def with_eos(source: Path, target: Path, eos_token_id: int) -> Path:
    """A copy of a model folder whose EOS token is `eos_token_id` (same weights)."""
    shutil.copytree(source, target)
    for name in ("config.json", "generation_config.json"):
        path = target / name
        if path.exists():
            data = json.loads(path.read_text())
            data["eos_token_id"] = eos_token_id
            path.write_text(json.dumps(data))
    tok_config = target / "tokenizer_config.json"
    data = json.loads(tok_config.read_text())
    data.pop("eos_token", None)
    tok_config.write_text(json.dumps(data))
    return target


def eos_variant(model_dir: str, target: Path, prompt: str) -> tuple[str, int]:
    """A copy of the model whose EOS is the token greedy decoding samples at index K >= 4
    after `prompt` (one not seen before it): greedy decoding of `prompt` then stops with EOS
    after exactly K tokens. Returns (folder, K). The token is no JSON punctuation: a JSON
    schema request on the copy must still be able to close its object."""
    from tritonserve.engine import LLM, SamplingParams
    llm = LLM(model_dir)
    tokens = llm.generate([prompt], SamplingParams(
        temperature=0.0, max_tokens=16, ignore_eos=True))[0].token_ids
    k = next(i for i in range(4, len(tokens)) if tokens[i] not in tokens[:i]
             and not set(llm.tokenizer.decode([tokens[i]])) & set('{}[]":,'))
    return str(with_eos(Path(model_dir), target, tokens[k])), k
