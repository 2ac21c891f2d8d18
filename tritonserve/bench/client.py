"""Sends one request, times every event, and validates the stream as it arrives."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import aiohttp

from .validator import NativeValidator, OpenAIValidator
from .workload import BenchRequest


@dataclass
class RequestRecord:
    ok: bool = False
    protocol_error: str | None = None
    error: str | None = None
    http_status: int | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None  # the server's count (done event or usage)
    client_output_tokens: int = 0  # token events / chunks seen
    finish_reason: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    tpot_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    server: dict | None = None  # the native done event's timing fields

    def to_dict(self) -> dict:
        return asdict(self)


def build_payload(endpoint: str, req: BenchRequest, model: str | None,
                  ignore_eos: bool, sampling: dict | None = None) -> tuple[str, dict]:
    """sampling: fields such as temperature and top_p; those left out take the server's
    defaults."""
    common = {"max_tokens": req.output_len, "stream": True, **(sampling or {})}
    if ignore_eos:
        common["ignore_eos"] = True
    if endpoint == "native":
        return "/generate", {"prompt": req.prompt, **common}
    extra = {"stream_options": {"include_usage": True}}
    if model:
        extra["model"] = model
    if endpoint == "completions":
        return "/v1/completions", {"prompt": req.prompt, **common, **extra}
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": req.as_text}],
                                    **common, **extra}


async def iter_sse(response: aiohttp.ClientResponse):
    """Yields each `data:` payload as a string."""
    buffer = b""
    async for chunk in response.content.iter_any():
        buffer += chunk
        while b"\n\n" in buffer:
            frame, buffer = buffer.split(b"\n\n", 1)
            for line in frame.split(b"\n"):
                if line.startswith(b"data:"):
                    yield line[5:].strip().decode()
    if buffer.strip():
        for line in buffer.split(b"\n"):
            if line.startswith(b"data:"):
                yield line[5:].strip().decode()


async def send(session: aiohttp.ClientSession, base_url: str, endpoint: str,
               req: BenchRequest, model: str | None, ignore_eos: bool,
               sampling: dict | None = None) -> RequestRecord:
    path, payload = build_payload(endpoint, req, model, ignore_eos, sampling)
    validator = (NativeValidator() if endpoint == "native"
                 else OpenAIValidator(chat=endpoint == "chat", expect_usage=True))
    record = RequestRecord()
    start = time.perf_counter()
    last = None
    try:
        async with session.post(base_url + path, json=payload) as response:
            record.http_status = response.status
            if response.status != 200:
                record.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return record
            async for data in iter_sse(response):
                is_token = validator.feed(data)
                now = time.perf_counter()
                if is_token:
                    if last is None:
                        record.ttft_s = now - start
                    else:
                        record.itl_s.append(now - last)
                    last = now
    except (aiohttp.ClientError, TimeoutError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        return record
    record.e2e_s = time.perf_counter() - start
    verdict = validator.finish()
    record.protocol_error = verdict.protocol_error
    record.error = record.error or verdict.error
    record.finish_reason = verdict.finish_reason
    record.prompt_tokens = verdict.prompt_tokens
    record.output_tokens = verdict.server_output_tokens
    record.client_output_tokens = verdict.client_output_tokens
    record.server = verdict.done
    record.ok = record.error is None and record.protocol_error is None
    n = record.output_tokens or record.client_output_tokens
    if record.ok and record.ttft_s is not None and n > 1:
        record.tpot_s = (record.e2e_s - record.ttft_s) / (n - 1)
    return record
