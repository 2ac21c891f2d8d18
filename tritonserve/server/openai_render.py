"""The OpenAI routes' renderers (server/driver.py's Renderer): completions and chat chunks,
their usage, logprobs and finish reasons. Each choice gets exactly one chunk with a
finish_reason (`stop` for EOS, a stop string or stop token; `length`; chat's `tool_calls`); a
failure is `data: {"error": ...}` with no finish_reason, then [DONE]; usage is always in
non-streaming responses and, with stream_options.include_usage, in a last chunk with no
choices.
"""
from __future__ import annotations

import time

from tritonserve.engine import FinishReason

from .chat_output import ChatOutput
from .common import error_body
from .driver import Choice, Payload, Renderer
from .logprobs_format import chat_logprobs, completion_logprobs, prompt_logprobs
from .schema import OpenAIFields
from .tools import ToolPlan

OPENAI_REASON = {FinishReason.EOS: "stop", FinishReason.STOP: "stop",
                 FinishReason.LENGTH: "length"}


def _usage(choices: list[Choice], n: int) -> dict:
    """Each prompt counted once (its first choice), with the tokens the prefix cache served."""
    firsts = [c.completion for c in choices if c.index % n == 0]
    prompt = sum(c.prompt_tokens for c in firsts)
    output = sum(c.completion.output_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": output, "total_tokens": prompt + output,
            "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in firsts)}}


class OpenAIRenderer(Renderer):
    """What completions and chat share: the chunk head, [DONE], usage, errors, logprobs."""

    object = ""

    def __init__(self, state, request_id: str, body: OpenAIFields, want_logprobs: bool,
                 prompt_lens: list[int]) -> None:
        self.prompts = state.engine.prompts
        self.model = state.engine.card.name
        self.head = {"id": request_id, "created": int(time.time()), "model": self.model}
        self.n = body.n
        self.want_logprobs = want_logprobs
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.extra = {"usage": None} if self.include_usage else {}
        # continuous_usage_stats: every chunk carries its choice's usage so far (vLLM's)
        self.continuous = self.include_usage and body.stream_options.continuous_usage_stats
        self.prompt_lens = prompt_lens  # per prompt
        self.generated: dict[int, int] = {}  # choice -> tokens streamed so far

    def chunk(self, choice: dict) -> dict:
        extra = self.extra
        if self.continuous:
            index = choice["index"]
            prompt, output = self.prompt_lens[index // self.n], self.generated.get(index, 0)
            extra = {"usage": {"prompt_tokens": prompt, "completion_tokens": output,
                               "total_tokens": prompt + output}}
        return {**self.head, "object": self.chunk_object, "choices": [choice], **extra}

    def token(self, index, token) -> list[Payload]:
        self.generated[index] = self.generated.get(index, 0) + 1
        return self.token_chunks(index, token)

    def token_chunks(self, index, token) -> list[Payload]:
        raise NotImplementedError

    def finish(self, index, completion) -> list[Payload]:
        self.generated[index] = completion.output_tokens  # the authoritative count
        return self.finish_chunks(index, completion)

    def finish_chunks(self, index, completion) -> list[Payload]:
        raise NotImplementedError

    @property
    def chunk_object(self) -> str:
        return self.object

    def failure(self, failure) -> list[Payload]:
        return [error_body(failure.code, failure.message, kind="server_error")]

    def end(self, choices: list[Choice], failed: bool) -> list[Payload]:
        if self.include_usage and not failed:
            return [{**self.head, "object": self.chunk_object, "choices": [],
                     "usage": _usage(choices, self.n)}, "[DONE]"]
        return ["[DONE]"]

    def response(self, choices: list[Choice]) -> dict:
        return {**self.head, "object": self.object,
                "choices": [self.full_choice(c) for c in choices],
                "usage": _usage(choices, self.n)}

    def full_choice(self, choice: Choice) -> dict:
        raise NotImplementedError


class CompletionRenderer(OpenAIRenderer):
    """echo puts the prompt's text first; with logprobs (or prompt_logprobs) the prompt's
    entries come from the engine on the choice's first step, so a stream sends the echo then
    (prompt()) instead of at once (start())."""

    object = "text_completion"

    def __init__(self, state, request_id, body, echo_texts: list[str] | None,
                 prompt_ids: list[list[int]]) -> None:
        super().__init__(state, request_id, body, body.logprobs is not None,
                         [len(p) for p in prompt_ids])
        self.echo_texts = echo_texts  # per prompt, when echo is set
        self.prompt_ids = prompt_ids
        self.echo_scores = bool(echo_texts) and body.logprobs is not None
        self.vllm_scores = body.prompt_logprobs is not None

    def _logprobs(self, tokens, index: int = 0, prompt=None) -> dict | None:
        if not self.want_logprobs or not (tokens or prompt):
            return None
        prompt_ids = self.prompt_ids[index // self.n] if prompt else ()
        return completion_logprobs(self.prompts.decode_token, tokens, prompt_ids, prompt or ())

    def _choice(self, index: int, text: str, tokens, finish: str | None,
                prompt=None) -> dict:
        choice = {"index": index, "text": text,
                  "logprobs": self._logprobs(tokens, index, prompt if self.echo_scores
                                             else None),
                  "finish_reason": finish}
        if self.vllm_scores and prompt is not None:
            choice["prompt_logprobs"] = prompt_logprobs(self.prompts.decode_token, prompt)
        return choice

    def start(self) -> list[Payload]:
        if not self.echo_texts or self.echo_scores:
            return []
        return [self.chunk(self._choice(i, self.echo_texts[i // self.n], [], None))
                for i in range(len(self.echo_texts) * self.n)]

    def prompt(self, index, entries) -> list[Payload]:
        echo = self.echo_texts[index // self.n] if self.echo_scores else ""
        if not echo and not self.vllm_scores:
            return []
        return [self.chunk(self._choice(index, echo, [], None, entries))]

    def token_chunks(self, index, token) -> list[Payload]:
        return [self.chunk(self._choice(index, token.text, [token], None))]

    def finish_chunks(self, index, completion) -> list[Payload]:
        return [self.chunk(self._choice(index, completion.tail_text, [],
                                        OPENAI_REASON[completion.reason]))]

    def full_choice(self, choice: Choice) -> dict:
        echo = self.echo_texts[choice.index // self.n] if self.echo_texts else ""
        return self._choice(choice.index, echo + choice.text, choice.tokens,
                            OPENAI_REASON[choice.completion.reason], choice.prompt_logprobs)


class ChatRenderer(OpenAIRenderer):
    """Each choice's text goes through a ChatOutput (server/chat_output.py): reasoning split
    off, tool calls parsed, both as they stream."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, state, request_id, body, plan: ToolPlan | None, prompt_len: int,
                 prompt_text: str = "", reasoning_parser: str | None = None) -> None:
        super().__init__(state, request_id, body, body.logprobs, [prompt_len])
        self._started: set[int] = set()
        self._output = lambda: ChatOutput(reasoning_parser, prompt_text, plan)
        self._outputs: dict[int, ChatOutput] = {}

    def _stream_of(self, index: int) -> ChatOutput:
        if index not in self._outputs:
            self._outputs[index] = self._output()
        return self._outputs[index]

    def _logprobs(self, tokens) -> dict | None:
        if not self.want_logprobs or not tokens:
            return None
        return chat_logprobs(self.prompts.decode_token, tokens)

    def _role(self, index: int, delta: dict) -> dict:
        if index not in self._started:  # the first chunk of each choice names the role
            self._started.add(index)
            return {"role": "assistant", "content": "", **delta}
        return delta

    def token_chunks(self, index, token) -> list[Payload]:
        delta = self._stream_of(index).delta(token.text)
        if not delta and not self.want_logprobs and index in self._started:
            return []  # held back (a tag or a call marker may be starting)
        return [self.chunk({"index": index, "delta": self._role(index, delta),
                            "logprobs": self._logprobs([token]), "finish_reason": None})]

    def finish_chunks(self, index, completion) -> list[Payload]:
        output = self._stream_of(index)
        delta = output.final_delta(completion.tail_text)
        finish = OPENAI_REASON[completion.reason]
        if output.has_calls and finish == "stop":
            finish = "tool_calls"
        return [self.chunk({"index": index, "delta": self._role(index, delta),
                            "logprobs": None, "finish_reason": finish})]

    def response(self, choices: list[Choice]) -> dict:
        body = super().response(choices)
        if choices and choices[0].prompt_logprobs is not None:  # vLLM's, on the response
            body["prompt_logprobs"] = prompt_logprobs(self.prompts.decode_token,
                                                      choices[0].prompt_logprobs)
        return body

    def full_choice(self, choice: Choice) -> dict:
        output = self._output()
        message = output.message(choice.text)
        finish = OPENAI_REASON[choice.completion.reason]
        if output.has_calls and finish == "stop":
            finish = "tool_calls"
        return {"index": choice.index, "message": message,
                "logprobs": self._logprobs(choice.tokens), "finish_reason": finish}
