"""Small async HTTP helpers shared by the conformance checks."""
from __future__ import annotations

import json
from dataclasses import dataclass

import aiohttp


@dataclass
class Reply:
    status: int
    content_type: str
    raw: bytes
    headers: dict | None = None  # lower-cased names

    @property
    def payloads(self) -> list[str]:
        out = []
        for frame in self.raw.decode(errors="replace").split("\n\n"):
            for line in frame.split("\n"):
                if line.startswith("data:"):
                    out.append(line[5:].strip())
        return out

    @property
    def events(self) -> list[tuple[str | None, str]]:
        """(the frame's `event:` name or None, its data) per SSE frame."""
        out = []
        for frame in self.raw.decode(errors="replace").split("\n\n"):
            name, data = None, []
            for line in frame.split("\n"):
                if line.startswith("event:"):
                    name = line[6:].strip()
                elif line.startswith("data:"):
                    data.append(line[5:].strip())
            if data:
                out.append((name, "\n".join(data)))
        return out

    def json(self):
        return json.loads(self.raw)


async def post(session: aiohttp.ClientSession, url: str, body: dict | bytes,
               headers: dict | None = None) -> Reply:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with session.post(url, data=data,
                            headers={"Content-Type": "application/json", **(headers or {})}
                            ) as response:
        raw = await response.read()
        return Reply(response.status, response.headers.get("Content-Type", ""), raw,
                     {k.lower(): v for k, v in response.headers.items()})
