"""The chat template and what a request may pass it.

The template is server configuration, never request data: the tokenizer's own, or
`--chat-template FILE`. A request's `chat_template_kwargs` reach the template as variables
(Qwen3's `enable_thinking`, ...), except the names the server passes itself or that would swap
the template: those are refused with a 400 naming the key (a request-supplied Jinja template
is a known way to pin a worker: vLLM's CVE-2025-61620). `reasoning_effort` goes to templates
that read it and is a 400 elsewhere.

Rendering runs on the prompt tokenizer's worker thread (server/prompts.py), never the event
loop, and under a time bound: a trace function watches the template's own frames and stops a
render past `--chat-template-timeout` seconds (Jinja's sandbox bounds one range() to 100,000
items, not two nested ones), so even the server's own template cannot hold the worker.

This file also picks the reasoning and tool-call parsers a template asks for, where the CLI
leaves them on "auto" (server/reasoning.py, server/tool_parsers.py).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from tritonserve.engine import InvalidRequestError

from . import harmony, reasoning, tool_parsers
from .errors import ApiError

# what the server passes apply_chat_template itself, or what would change how it renders
RESERVED_KWARGS = frozenset((
    "chat_template", "messages", "conversation", "tools", "documents", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "reasoning_effort"))
REASONING_EFFORTS = ("minimal", "low", "medium", "high")


class TemplateTimeout(Exception):
    """The template ran past its time bound."""


class ChatTemplate:
    def __init__(self, source: str | None, timeout: float, reasoning_parser: str = "auto",
                 tool_parser: str = "auto") -> None:
        self.source = source
        self.timeout = timeout
        written = harmony.is_harmony(source)  # gpt-oss: reasoning and calls are its channels
        self.reasoning_parser = ((harmony.PARSER if written else reasoning.pick_parser(source))
                                 if reasoning_parser == "auto"
                                 else None if reasoning_parser == "none" else reasoning_parser)
        self.tool_parser = ((harmony.TOOL_PARSER if self.reasoning_parser == harmony.PARSER
                             else tool_parsers.pick_parser(source))
                            if tool_parser == "auto" else tool_parser)
        if (self.reasoning_parser == harmony.PARSER) != (self.tool_parser == harmony.TOOL_PARSER):
            raise ValueError(f"--reasoning-parser {harmony.PARSER} and --tool-call-parser "
                             f"{harmony.TOOL_PARSER} go together (both read the harmony format's "
                             f"channels); got {self.reasoning_parser} and {self.tool_parser}")

    @property
    def harmony(self) -> bool:
        """The output is gpt-oss's harmony format (server/harmony.py)."""
        return self.reasoning_parser == harmony.PARSER

    @classmethod
    def load(cls, path: str | None, tokenizer_template: str | None, timeout: float,
             reasoning_parser: str = "auto", tool_parser: str = "auto") -> ChatTemplate:
        """`path`: --chat-template's file (a missing one is a ValueError at start-up)."""
        source = tokenizer_template
        if path is not None:
            file = Path(path)
            if not file.is_file():
                raise ValueError(f"chat_template: no file {path}")
            source = file.read_text()
        return cls(source, timeout, reasoning_parser, tool_parser)

    def kwargs_for(self, chat_template_kwargs: dict | None,
                   reasoning_effort: str | None) -> dict:
        """The variables a request adds to the template, checked."""
        kwargs = dict(chat_template_kwargs or {})
        for key in kwargs:
            if key in RESERVED_KWARGS or key.startswith("_"):
                raise InvalidRequestError(
                    f"chat_template_kwargs.{key}", f"{key!r} cannot be set by a request: the "
                    "chat template and what it is given are server configuration")
        if reasoning_effort is not None:
            if reasoning_effort not in REASONING_EFFORTS:
                raise InvalidRequestError("reasoning_effort", f"must be one of "
                                          f"{REASONING_EFFORTS}, got {reasoning_effort!r}")
            if "reasoning_effort" not in (self.source or ""):
                raise ApiError(400, "unsupported_parameter", "this model's chat template takes "
                               "no reasoning_effort", "reasoning_effort")
            kwargs["reasoning_effort"] = reasoning_effort
        return kwargs

    def render(self, tokenizer, messages: list[dict], tools: list[dict] | None,
               kwargs: dict) -> str:
        """On the tokenizer's worker thread; TemplateTimeout past the bound."""
        deadline = time.monotonic() + self.timeout

        def in_template(frame, event, arg):  # a line of the compiled template
            if time.monotonic() > deadline:
                raise TemplateTimeout(f"the chat template ran past {self.timeout:g} s")
            return in_template

        def on_call(frame, event, arg):  # only Jinja's compiled code is traced line by line
            return in_template if frame.f_code.co_filename == "<template>" else None

        previous = sys.gettrace()
        sys.settrace(on_call)
        try:
            return tokenizer.apply_chat_template(
                messages, tools=tools, chat_template=self.source, tokenize=False,
                add_generation_prompt=True, **kwargs)
        finally:
            sys.settrace(previous)
