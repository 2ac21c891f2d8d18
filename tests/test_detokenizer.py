"""Incremental detokenization and stop strings with the real SmolLM2 tokenizer."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tritonserve.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher

pytestmark = pytest.mark.smollm2


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(smollm2_path)


def stream(tokenizer, ids, stop=(), include_stop=False):
    """The engine's text path: detokenizer -> stop matcher; returns (deltas, tail, stop_index)."""
    detok = IncrementalDetokenizer(tokenizer)
    matcher = StopStringMatcher(tuple(stop), include_stop)
    deltas = []
    for i, token_id in enumerate(ids):
        check = matcher.feed(detok.add_token(token_id))
        deltas.append(check.text)
        if check.matched:
            return deltas, "", i
    check = matcher.feed(detok.flush())
    return deltas, check.text + ("" if check.matched else matcher.flush()), None


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE vocabularies use it)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_tokens(tokenizer, text):
    """One byte-level token per UTF-8 byte: every multi-byte character is split."""
    table = byte_level_alphabet()
    return [tokenizer.convert_tokens_to_ids(table[b]) for b in text.encode("utf-8")]


@pytest.mark.parametrize("text", ["你好世界，今天天气很好。", "Emoji: 😀🚀🎉👩‍👩‍👧 done",
                                  "café naïve 日本語 한국어 Привет"])
def test_multibyte_prompts_add_up_without_replacement_chars(tokenizer, text):
    ids = tokenizer.encode(text)
    deltas, tail, _ = stream(tokenizer, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + tail == tokenizer.decode(ids) == text


@pytest.mark.parametrize("text", ["😀", "你好", "é!", "👩‍👩‍👧"])
def test_split_characters_are_held_then_released_whole(tokenizer, text):
    ids = byte_tokens(tokenizer, text)
    deltas, tail, _ = stream(tokenizer, ids)
    assert "".join(deltas) + tail == text
    assert all("\ufffd" not in d for d in deltas)
    first = text[0].encode("utf-8")
    assert deltas[:len(first) - 1] == [""] * (len(first) - 1), "partial bytes must be held"
    assert deltas[len(first) - 1] == text[0]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(17, 49151), min_size=1, max_size=40))
def test_deltas_always_add_up_to_decode(tokenizer, ids):
    deltas, tail, _ = stream(tokenizer, ids)
    assert "".join(deltas) + tail == tokenizer.decode(ids, skip_special_tokens=True)


def find_span(tokenizer, ids, span):
    """A stop string covering the end of token i, all tokens between, and the start of token
    i + span - 1, chosen where each piece is plain ASCII text."""
    pieces = [tokenizer.decode([t]) for t in ids]
    for i in range(1, len(ids) - span):
        window = pieces[i:i + span]
        if all(len(p) >= 2 and p.isascii() for p in window):
            stop = window[0][-2:] + "".join(window[1:-1]) + window[-1][:2]
            prefix = "".join(pieces[:i]) + window[0][:-2]
            if stop not in prefix + window[0][:-1]:
                return stop, prefix, i + span - 1
    raise AssertionError("no suitable span")


@pytest.mark.parametrize("span", [2, 3])
def test_stop_string_spanning_tokens(tokenizer, span):
    text = "The scheduler hands out a token budget to running requests first, then waiting ones."
    ids = tokenizer.encode(text)
    stop, prefix, last_index = find_span(tokenizer, ids, span)
    deltas, tail, matched_at = stream(tokenizer, ids, stop=[stop])
    assert matched_at == last_index
    assert "".join(deltas) == prefix
    assert stop not in "".join(deltas)
    deltas, _, _ = stream(tokenizer, ids, stop=[stop], include_stop=True)
    assert "".join(deltas) == prefix + stop


def test_stop_string_at_the_very_first_token(tokenizer):
    ids = tokenizer.encode("Hello world, again")
    first = tokenizer.decode(ids[:1])
    deltas, tail, matched_at = stream(tokenizer, ids, stop=[first[:2]])
    assert matched_at == 0 and deltas == [""] and tail == ""


def test_possible_stop_prefix_is_held_then_released(tokenizer):
    ids = tokenizer.encode("a#b##c")
    deltas, tail, matched = stream(tokenizer, ids, stop=["###"])
    assert matched is None
    assert "".join(deltas) + tail == "a#b##c"


@given(st.lists(st.integers(0, 49151), max_size=12), st.booleans())
@settings(max_examples=200, deadline=None)
def test_the_plain_decode_is_the_tokenizers_decode(tokenizer, ids, skip):
    """The detokenizer's shortcut past transformers' wrapper gives the wrapper's text, for
    any ids (special tokens included, skipped or not)."""
    from tritonserve.engine.detokenizer import plain_decode
    plain = plain_decode(tokenizer)
    assert plain is not None  # SmolLM2's tokenizer takes it
    assert plain(ids, skip) == tokenizer.decode(ids, skip_special_tokens=skip,
                                                clean_up_tokenization_spaces=False)


def test_a_tokenizer_with_its_own_decode_keeps_it(tokenizer):
    """A tokenizer class that overrides the decode path is never bypassed."""
    from tritonserve.engine.detokenizer import plain_decode

    class Shouting(type(tokenizer)):
        def _decode(self, token_ids, **kwargs):
            return super()._decode(token_ids, **kwargs).upper()

    shouting = Shouting.__new__(Shouting)
    shouting.__dict__.update(tokenizer.__dict__)
    assert plain_decode(shouting) is None
    detok = IncrementalDetokenizer(shouting)
    ids = tokenizer.encode("hello there")
    assert "".join(detok.add_token(i) for i in ids) + detok.flush() == "HELLO THERE"
