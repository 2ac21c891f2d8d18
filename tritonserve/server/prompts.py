"""Prompt text to token ids, off the event loop: the server's own tokenizer on one worker
thread (the engine thread keeps its own for detokenizing, and the event loop a third, loaded
on first use, to name logprob tokens: one thread per tokenizer, since a Rust tokenizer that is
encoding refuses a concurrent call with "Already borrowed").

Before any tokenizer work, a cheap bound: a prompt of C characters has at least
C / max_token_chars tokens, so one longer than max_model_len * max_token_chars characters can
never fit and is refused at once (a 15 MB prompt used to hold the event loop for ~15 s).
Text with lone UTF-16 surrogates (valid JSON, not valid Unicode) is refused by name too.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from transformers import AutoTokenizer

from tritonserve.engine import InvalidRequestError

from .chat_template import ChatTemplate
from .config import ServerConfig

DEFAULT_TEMPLATE_TIMEOUT = ServerConfig.chat_template_timeout


def max_token_chars(tokenizer) -> int:
    """The most characters one token can stand for. Vocabulary entries are written at least as
    long as their decoded text (byte-level "Ġthe", SentencePiece "▁the", "<0xE4>" fallback)."""
    return max(len(piece) for piece in tokenizer.get_vocab())


def text_chars(value) -> int:
    """The characters of every string (keys included) in a JSON-like value; iterative."""
    total, todo = 0, [value]
    while todo:
        item = todo.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            todo.extend(item.keys())
            todo.extend(item.values())
        elif isinstance(item, (list, tuple)):
            todo.extend(item)
    return total


def check_text(field: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequestError(field, "must be valid Unicode (it holds a lone surrogate)") \
            from None


class PromptTokenizer:
    def __init__(self, model_path: Path, max_model_len: int) -> None:
        self._model_path = model_path
        self._tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        self._loop_tokenizer = None
        self.max_chars = max_model_len * max_token_chars(self._tokenizer)
        self._max_model_len = max_model_len
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)

    def _check_length(self, field: str, chars: int) -> None:
        if chars > self.max_chars:
            raise InvalidRequestError(
                field, f"{chars} characters cannot fit in max_model_len {self._max_model_len} "
                f"tokens (at most {self.max_chars} characters)")

    async def _run(self, field: str, fn, *args):
        try:
            return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)
        except InvalidRequestError:
            raise
        except Exception as exc:  # noqa: BLE001 - the tokenizer refused the user's text
            raise InvalidRequestError(field, f"was refused by the tokenizer or chat template: "
                                      f"{exc}") from None

    async def encode(self, text: str, field: str = "prompt",
                     add_special_tokens: bool = True) -> list[int]:
        self._check_length(field, len(text))
        check_text(field, text)
        return await self._run(field, self._encode, text, add_special_tokens)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)

    async def decode(self, token_ids: list[int], field: str = "tokens") -> str:
        """Token ids -> text (ids outside the vocabulary are the caller's to refuse)."""
        return await self._run(field, self._tokenizer.decode, token_ids)

    @property
    def template_source(self) -> str | None:
        """The tokenizer's own chat template (server/chat_template.py may replace it)."""
        return self._tokenizer.chat_template

    async def encode_chat(self, messages: list[dict], tools: tuple[dict, ...] | None = None,
                          template: ChatTemplate | None = None,
                          kwargs: dict | None = None) -> tuple[list[int], str]:
        """The chat template applied to the messages (and tools), tokenized: (ids, text)."""
        chars = text_chars(tools or ())  # the template writes the tools out too
        for i, message in enumerate(messages):
            for key, value in message.items():
                if isinstance(value, str):
                    check_text(f"messages.{i}.{key}", value)
            # every string of it (names, tool calls' arguments), and one for the message
            # itself: 120k empty messages passed a count of their content alone
            chars += text_chars(message) + 1
        self._check_length("messages", chars)
        template = template or ChatTemplate(None, DEFAULT_TEMPLATE_TIMEOUT)
        return await self._run("messages", self._chat_ids, messages, tools, template,
                               kwargs or {})

    def _chat_ids(self, messages: list[dict], tools: tuple[dict, ...] | None,
                  template: ChatTemplate, kwargs: dict) -> tuple[list[int], str]:
        text = template.render(self._tokenizer, messages, list(tools) if tools else None,
                               kwargs)
        return self._tokenizer.encode(text, add_special_tokens=False), text

    def decode_token(self, token_id: int) -> str:
        """One token's text, on the event loop (for logprobs)."""
        if self._loop_tokenizer is None:
            self._loop_tokenizer = AutoTokenizer.from_pretrained(str(self._model_path))
        return self._loop_tokenizer.decode([token_id])
