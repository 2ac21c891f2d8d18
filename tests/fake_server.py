"""A tiny deterministic server that speaks both protocols, with one injectable fault each,
to prove that the conformance suite catches what it claims to catch."""
from __future__ import annotations

import asyncio
import json
import random
import time

from aiohttp import web
from pydantic import ValidationError

from tritonserve.server.common import ApiError, sampling_params
from tritonserve.server.schema import CompletionRequest, GenerateRequest

VOCAB = ["Hel", "lo", ",", " wor", "ld", " 你", "好", "！", " ca", "fé", " 😀", " the",
         " end", ".", " and", " so", " on"]
FAULTS = ("skipped_index", "missing_done", "count_mismatch", "event_after_done",
          "error_as_200_sse", "held_back_last_token", "no_done_sentinel")


def continuation(prompt: str, max_tokens: int, ignore_eos: bool, seed, temperature):
    """-> (token texts, finish reason). Greedy is a fixed walk; EOS after 3-7 tokens."""
    rng = random.Random(seed if temperature else len(prompt))
    start = len(prompt) % len(VOCAB)
    texts = []
    eos_after = 3 + len(prompt) % 5
    for i in range(max_tokens):
        if not ignore_eos and i == eos_after:
            return texts, "eos"
        step = rng.randrange(1, 4) if temperature else 1
        start = (start + step) % len(VOCAB)
        texts.append(VOCAB[start])
    return texts, "length"


def apply_stop(texts: list[str], reason: str, stop):
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    full = "".join(texts)
    hits = [(full.find(s), s) for s in stops if s in full]
    if not hits:
        return texts, reason
    at, s = min(hits)
    out, used = [], 0
    for text in texts:
        keep = max(0, min(len(text), at - used))
        out.append(text[:keep])
        used += len(text)
        if used >= at + len(s):
            break
    return out, "stop"


class FakeServer:
    def __init__(self, fault: str | None = None) -> None:
        assert fault in FAULTS + (None,)
        self.fault = fault
        self.app = web.Application()
        self.app.router.add_post("/generate", self.generate)
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_post("/v1/chat/completions", self.completions)

    async def _parse(self, request, model):
        """(body, its SamplingParams) or (None, problem): the real server's rules."""
        try:
            body = model.model_validate(json.loads(await request.read()))
            return (body, sampling_params(body, None)), None
        except (json.JSONDecodeError, ValidationError, UnicodeDecodeError, ApiError) as exc:
            return None, str(exc)[:200]

    async def generate(self, request: web.Request) -> web.StreamResponse:
        arrival = time.perf_counter()
        parsed, problem = await self._parse(request, GenerateRequest)
        if problem:
            if self.fault == "error_as_200_sse":
                response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await response.prepare(request)
                await response.write(b'data: {"type": "error", "code": "invalid", '
                                     b'"message": "bad"}\n\n')
                return response
            return web.json_response({"error": {"code": "invalid_request",
                                                "message": problem}}, status=400)
        body, params = parsed
        texts, reason = continuation(str(body.prompt), params.max_tokens, params.ignore_eos,
                                     params.seed, params.temperature)
        texts, reason = apply_stop(texts, reason, params.stop)
        held = ""
        if self.fault == "held_back_last_token" and texts:
            held, texts = texts[-1], texts[:-1]
        done = {"type": "done", "finish_reason": reason, "prompt_tokens": 4,
                "output_tokens": len(texts) + (self.fault == "count_mismatch"), "text": held,
                "ttft_ms": 0.0, "total_ms": 0.0, "queue_wait_ms": 0.0, "execution_ms": 0.0,
                "tokens_per_s": 0.0}
        if not body.stream:
            total = (time.perf_counter() - arrival) * 1000
            return web.json_response({**done, "text": "".join(texts) + held,
                                      "total_ms": total, "execution_ms": total,
                                      "token_ids": list(range(len(texts)))})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        first = None
        for i, text in enumerate(texts):
            index = i + 1 if self.fault == "skipped_index" and i else i
            event = {"type": "token", "index": index, "text": text, "token_id": i}
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
            first = first or time.perf_counter()
            await asyncio.sleep(0.001)
        end = time.perf_counter()
        total = (end - arrival) * 1000
        done.update(ttft_ms=((first or end) - arrival) * 1000, total_ms=total,
                    execution_ms=total, tokens_per_s=len(texts) / max(total, 1e-9) * 1000)
        if self.fault != "missing_done":
            await response.write(f"data: {json.dumps(done)}\n\n".encode())
        if self.fault == "event_after_done":
            await response.write(b'data: {"type": "token", "index": 99, "text": "x", '
                                 b'"token_id": 1}\n\n')
        return response

    async def completions(self, request: web.Request) -> web.StreamResponse:
        chat = request.path.endswith("chat/completions")
        try:
            raw = json.loads(await request.read())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return web.json_response({"error": {"message": str(exc)}}, status=400)
        if chat and isinstance(raw, dict) and raw.get("messages"):
            raw = {**{k: v for k, v in raw.items() if k != "messages"},
                   "prompt": raw["messages"][-1]["content"]}
        try:
            body = CompletionRequest.model_validate(raw)
            params = sampling_params(body, None)
        except (ValidationError, ApiError) as exc:
            return web.json_response({"error": {"message": str(exc)[:200]}}, status=400)
        texts, reason = continuation(str(body.prompt), params.max_tokens, params.ignore_eos,
                                     params.seed, params.temperature)
        finish = "length" if reason == "length" else "stop"
        usage = {"prompt_tokens": 4, "completion_tokens": len(texts),
                 "total_tokens": 4 + len(texts)}

        def choice(text, finish_reason):
            if chat:
                return {"index": 0, "delta": {"role": "assistant", "content": text},
                        "finish_reason": finish_reason}
            return {"index": 0, "text": text, "finish_reason": finish_reason}

        if not body.stream:
            message = ({"message": {"role": "assistant", "content": "".join(texts)}} if chat
                       else {"text": "".join(texts)})
            return web.json_response({"choices": [{"index": 0, **message,
                                                   "finish_reason": finish}], "usage": usage})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for text in texts:
            await response.write(f"data: {json.dumps({'choices': [choice(text, None)]})}\n\n"
                                 .encode())
        await response.write(f"data: {json.dumps({'choices': [choice('', finish)]})}\n\n"
                             .encode())
        if body.stream_options and body.stream_options.include_usage:
            await response.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                                 .encode())
        if self.fault != "no_done_sentinel":
            await response.write(b"data: [DONE]\n\n")
        return response
