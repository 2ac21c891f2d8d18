"""Stream validators: a stream that breaks the protocol is recorded as a protocol_error,
never silently counted. The server's own count is authoritative; the client's count is kept
beside it for the check.

Native rules (docs/protocol.md): every payload parses against the event schema (unknown
fields are errors); token indices are contiguous from 0; exactly one terminal event (done or
error) and nothing after it; done.output_tokens equals the token events seen; done's timing
fields are all present and numeric; an error event is the request's error, not a protocol
error; a stream that ends without a terminal event is a protocol error.

OpenAI rules: `[DONE]` present and last; exactly one finish_reason; usage present when asked
for, with total = prompt + completion and completion >= the token chunks seen; an error
payload is the request's error.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from pydantic import ValidationError

from tritonserve.server.schema import (STREAM_EVENT, StreamDoneEvent, StreamErrorEvent,
                                       StreamTokenEvent)


@dataclass
class StreamVerdict:
    protocol_error: str | None = None
    error: str | None = None  # a well-formed error event / payload from the server
    finish_reason: str | None = None
    server_output_tokens: int | None = None
    client_output_tokens: int = 0
    prompt_tokens: int | None = None
    text: str = ""
    done: dict | None = None


@dataclass
class _Validator:
    verdict: StreamVerdict = field(default_factory=StreamVerdict, init=False)

    def _fail(self, message: str) -> None:
        """Keeps the first violation: later ones are usually its consequences."""
        if self.verdict.protocol_error is None:
            self.verdict.protocol_error = message


@dataclass
class NativeValidator(_Validator):
    _terminal_seen: bool = False

    def feed(self, payload: str) -> bool:
        """One `data:` payload. Returns True when it is a token event (for timing)."""
        if self._terminal_seen:
            self._fail("event after the terminal event")
            return False
        try:
            event = STREAM_EVENT.validate_json(payload)
        except ValidationError as exc:
            problem = exc.errors()[0]
            where = ".".join(str(p) for p in problem["loc"])
            self._fail(f"event does not match the schema ({where}: {problem['msg']})")
            return False
        v = self.verdict
        if isinstance(event, StreamTokenEvent):
            if event.index != v.client_output_tokens:
                kind = "duplicate" if event.index < v.client_output_tokens else "skipped"
                self._fail(f"{kind} token index: expected {v.client_output_tokens}, "
                           f"got {event.index}")
            v.client_output_tokens += 1
            v.text += event.text
            return True
        self._terminal_seen = True
        if isinstance(event, StreamErrorEvent):
            v.error = f"{event.code}: {event.message}"
            return False
        assert isinstance(event, StreamDoneEvent)
        v.done = event.model_dump()
        v.finish_reason = event.finish_reason
        v.server_output_tokens = event.output_tokens
        v.prompt_tokens = event.prompt_tokens
        v.text += event.text
        if event.output_tokens != v.client_output_tokens:
            self._fail(f"done.output_tokens is {event.output_tokens} but "
                       f"{v.client_output_tokens} token events arrived")
        return False

    def finish(self) -> StreamVerdict:
        if not self._terminal_seen:
            self._fail("the stream ended without a terminal event")
        return self.verdict


@dataclass
class OpenAIValidator(_Validator):
    chat: bool = False
    expect_usage: bool = False
    _done_seen: bool = False
    _finishes: int = 0
    _usage: dict | None = None

    def feed(self, payload: str) -> bool:
        if self._done_seen:
            self._fail("data after [DONE]")
            return False
        if payload == "[DONE]":
            self._done_seen = True
            return False
        try:
            chunk = json.loads(payload)
        except json.JSONDecodeError:
            self._fail(f"payload is not JSON: {payload[:80]!r}")
            return False
        if "error" in chunk:
            error = chunk["error"]
            self.verdict.error = (f"{error.get('code')}: {error.get('message')}"
                                  if isinstance(error, dict) else str(error))
            return False
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        is_token = False
        for choice in chunk.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
            if choice.get("finish_reason") is not None:
                self._finishes += 1
                self.verdict.finish_reason = choice["finish_reason"]
                if piece:
                    self.verdict.text += piece
                continue
            if piece is not None:
                self.verdict.text += piece
                if piece or not self.chat:
                    self.verdict.client_output_tokens += 1
                    is_token = True
        return is_token

    def finish(self) -> StreamVerdict:
        v = self.verdict
        if not self._done_seen:
            self._fail("the stream ended without [DONE]")
        if v.error is None:
            if self._finishes != 1:
                self._fail(f"{self._finishes} chunks carried a finish_reason (expected 1)")
            if self.expect_usage and self._usage is None:
                self._fail("usage was asked for (include_usage) but never sent")
        if self._usage is not None:
            u = self._usage
            v.server_output_tokens = u.get("completion_tokens")
            v.prompt_tokens = u.get("prompt_tokens")
            # a peer proxy's usage (bench/peer_proxy.py) carries completion_tokens alone
            if "total_tokens" in u and u["total_tokens"] != (u.get("prompt_tokens") or 0) + (
                    u.get("completion_tokens") or 0):
                self._fail(f"usage does not add up: {u}")
            elif (u.get("completion_tokens") or 0) < v.client_output_tokens:
                self._fail(f"usage.completion_tokens {u.get('completion_tokens')} is below "
                           f"the {v.client_output_tokens} token chunks seen")
        return v
