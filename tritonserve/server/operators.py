"""What an operator puts in front of the routes: an API key, CORS for browser clients, and the
caller's X-Request-Id taken as the request's id (server/config.py holds the settings).

- API key (`--api-key`, or TRITONSERVE_API_KEY): every route but the probes (/health,
  /metrics, /version, and what a router reads: /get_load, /model_info, /server_info;
  `--auth-probes` closes them too) wants `Authorization: Bearer KEY`
  (or `X-Api-Key: KEY`); compared in constant time; else 401 with OpenAI's error shape.
- CORS (`--allowed-origins`, comma-separated, `*` for any): a browser's preflight (OPTIONS
  with Access-Control-Request-Method) is answered 204 before the key is asked for (browsers
  send no credentials on a preflight), and every response to an allowed Origin carries
  Access-Control-Allow-Origin. No origin is allowed by default.
- X-Request-Id: 1-128 characters of [A-Za-z0-9._:-]; used as the request's id (so logs,
  metrics and the response header name the caller's id), else one is generated; an id still
  in flight is refused (400), as one that does not fit.
"""
from __future__ import annotations

import hmac
import re

from aiohttp import web

from .common import STATE, ApiError, json_error, new_request_id

# what load balancers and routers read (server/routes_cluster.py): no data, no key needed
PROBES = ("/health", "/metrics", "/version", "/get_load", "/model_info", "/get_model_info",
          "/server_info", "/get_server_info")
PAGES = ("/",)  # the playground: static, no data; its API calls carry the key
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_CORS_METHODS = "GET, POST, OPTIONS"
_CORS_HEADERS = "Authorization, Content-Type, X-Api-Key, X-Request-Id"


def _given_key(request: web.Request) -> str:
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return request.headers.get("X-Api-Key", "")


def _allowed_origin(request: web.Request) -> str | None:
    origin = request.headers.get("Origin")
    allowed = request.app[STATE].config.allowed_origins
    if origin is None or not allowed:
        return None
    return origin if "*" in allowed or origin in allowed else None


@web.middleware
async def cors(request: web.Request, handler):
    origin = _allowed_origin(request)
    if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
        if origin is None:
            return json_error(403, "origin_not_allowed", "this origin is not allowed "
                              "(--allowed-origins)")
        return web.Response(status=204, headers={
            "Access-Control-Allow-Origin": origin, "Access-Control-Allow-Methods": _CORS_METHODS,
            "Access-Control-Allow-Headers": _CORS_HEADERS, "Access-Control-Max-Age": "600",
            "Vary": "Origin"})
    response = await handler(request)
    if origin is not None:
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Access-Control-Expose-Headers"] = "X-Request-Id"
        response.headers["Vary"] = "Origin"
    return response


@web.middleware
async def api_key(request: web.Request, handler):
    config = request.app[STATE].config
    if config.api_key is None or request.path in PAGES or (
            request.path in PROBES and not config.auth_probes):
        return await handler(request)
    # a header that is not UTF-8 reaches here with surrogate escapes (aiohttp's decoding):
    # its own bytes back, never an encoding error (that was a 500)
    given = _given_key(request).encode("utf-8", "surrogateescape")
    if not hmac.compare_digest(given, config.api_key.encode()):
        return json_error(401, "invalid_api_key", "a valid API key is required: "
                          "Authorization: Bearer KEY", headers={"WWW-Authenticate": "Bearer"})
    return await handler(request)


def request_id(request: web.Request, prefix: str) -> str:
    """The caller's X-Request-Id when it fits and is not in flight, else a fresh id."""
    given = request.headers.get("X-Request-Id")
    if given is None:
        return new_request_id(prefix)
    if not _REQUEST_ID.fullmatch(given):
        raise ApiError(400, "invalid_request", "X-Request-Id must be 1-128 characters of "
                       "letters, digits and ._:-", "X-Request-Id")
    if request.app[STATE].engine.in_flight(given):
        raise ApiError(400, "invalid_request", f"X-Request-Id {given!r} names a request "
                       "still in flight", "X-Request-Id")
    return given
