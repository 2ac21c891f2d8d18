"""POST /v1/embeddings (OpenAI's): `input` as a string, a list of strings, token ids or a
list of token-id lists; `encoding_format` float or base64 (little-endian float32, what the
`openai` SDK asks for by default); `dimensions` where the model declares Matryoshka
embeddings. Each input is one engine request with SamplingParams.pooling (engine/pooling.py):
scheduled beside generation under the same token budget, it samples nothing and ends with
its pooled vector, which is truncated and normalised here as the model's Pooling says.
"""
from __future__ import annotations

import base64
import struct
from typing import Literal

from aiohttp import web
from pydantic import Field

from tritonserve.engine import SamplingParams
from tritonserve.engine.pooling import finish

from .common import ApiError
from .driver import Choice, Renderer, respond
from .routes_openai import lora_of, opened, prompt_list, started
from .schema import Strict


class EmbeddingRequest(Strict):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] = Field(min_length=1)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


class EmbeddingsRenderer(Renderer):
    def __init__(self, model: str, body: EmbeddingRequest, normalize: bool,
                 prompt_tokens: int) -> None:
        self.model, self.body, self.normalize = model, body, normalize
        self.prompt_tokens = prompt_tokens

    def _encoded(self, vector: list[float]):
        if self.body.encoding_format == "float":
            return vector
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()

    def response(self, choices: list[Choice]) -> dict:
        data = [{"object": "embedding", "index": c.index, "embedding": self._encoded(
            finish(c.embedding, self.normalize, self.body.dimensions))} for c in choices]
        return {"object": "list", "data": data, "model": self.model,
                "usage": {"prompt_tokens": self.prompt_tokens,
                          "total_tokens": self.prompt_tokens}}


async def embeddings(request: web.Request) -> web.Response:
    state, arrival, body = await opened(request, EmbeddingRequest, ())
    card = state.engine.card
    pooling = card.pooling
    if body.dimensions is not None:
        if not pooling.matryoshka:
            raise ApiError(400, "unsupported_parameter", "this model does not declare "
                           "Matryoshka embeddings (is_matryoshka or matryoshka_dimensions in "
                           "its config.json): dimensions cannot truncate them", "dimensions")
        if not 1 <= body.dimensions <= card.hidden_size:
            raise ApiError(400, "invalid_request", f"dimensions must be in [1, "
                           f"{card.hidden_size}], got {body.dimensions}", "dimensions")
    inputs = prompt_list(body.input)
    if len(inputs) > state.config.max_waiting:
        raise ApiError(400, "invalid_request", f"input has {len(inputs)} items; at most "
                       f"{state.config.max_waiting} (--max-waiting) per request", "input")
    ids = []
    for i, item in enumerate(inputs):
        field = "input" if len(inputs) == 1 else f"input.{i}"
        if isinstance(item, str):
            ids.append(await state.engine.prompts.encode(item, field))
        elif not item:
            raise ApiError(400, "invalid_request", "must not be empty", field)
        else:
            ids.append(list(item))
    params = SamplingParams(max_tokens=0, pooling=pooling.kind)
    request_id = started(request, "embd")
    items = await state.engine.submit(request_id, ids, params, arrival,
                                      lora=lora_of(state, body.model))
    renderer = EmbeddingsRenderer(body.model or card.name, body, pooling.normalize,
                                  sum(len(p) for p in ids))
    return await respond(request, request_id, items, renderer, stream=False)
