"""Protocol-conformance suite: does a live server speak the explicit token/done/error
protocol (and the OpenAI streaming dialect) correctly, under the cases that broke others?

tritonserve bench conformance --base-url URL [--api native|openai|agents] [--model NAME]
    [--only CHECK ...] [--json PATH] [--api-key KEY]

One line per check (PASS / FAIL / SKIP, with the evidence); exit 0 only when nothing failed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict, dataclass, field

import aiohttp

from . import (checks_agent_apis, checks_native, checks_openai, checks_openai_agents,
               checks_openai_features)
from .checks_native import CheckFailed, Skipped

SUITES = {"native": checks_native.CHECKS,
          "openai": (checks_openai.CHECKS + checks_openai_features.CHECKS
                     + checks_openai_agents.CHECKS),
          # OpenAI's Responses and Anthropic's Messages streams (what agents read)
          "agents": checks_agent_apis.CHECKS}


@dataclass
class Context:
    base_url: str
    session: aiohttp.ClientSession
    model: str | None = None
    cache: dict = field(default_factory=dict)
    api_key: str | None = None  # the server's key (sent with every request)


@dataclass
class CheckResult:
    name: str
    status: str  # pass | fail | skip
    evidence: str


async def run_checks(base_url: str, api: str = "native", model: str | None = None,
                     only: list[str] | None = None, timeout: float = 300,
                     api_key: str | None = None) -> list[CheckResult]:
    checks = SUITES[api]
    names = [c.__name__ for c in checks]
    unknown = sorted(set(only or ()) - set(names))
    if unknown:
        raise ValueError(f"unknown checks {unknown}; {api} checks are {names}")
    results = []
    client_timeout = aiohttp.ClientTimeout(total=timeout)
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with aiohttp.ClientSession(timeout=client_timeout, headers=auth) as session:
        ctx = Context(base_url.rstrip("/"), session, model, api_key=api_key)
        for check in checks:
            if only and check.__name__ not in only:
                continue
            try:
                results.append(CheckResult(check.__name__, "pass", await check(ctx)))
            except Skipped as exc:
                results.append(CheckResult(check.__name__, "skip", str(exc)))
            except CheckFailed as exc:
                results.append(CheckResult(check.__name__, "fail", str(exc)))
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as exc:
                results.append(CheckResult(check.__name__, "fail",
                                           f"{type(exc).__name__}: {exc}"))
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tritonserve bench conformance")
    p.add_argument("--base-url", required=True)
    p.add_argument("--api", choices=sorted(SUITES), default="native")
    p.add_argument("--model", default=None)
    p.add_argument("--only", nargs="*", default=None, metavar="CHECK")
    p.add_argument("--api-key", default=None, help="the server's key: sent with every "
                   "request, and the 401 check runs")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    try:
        results = asyncio.run(run_checks(args.base_url, args.api, args.model, args.only,
                                         api_key=args.api_key))
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    for r in results:
        line = f"{r.status.upper():<5} {r.name}"
        print(f"{line}: {r.evidence}" if r.evidence else line)
    failed = sum(r.status == "fail" for r in results)
    print(f"{sum(r.status == 'pass' for r in results)} passed, {failed} failed, "
          f"{sum(r.status == 'skip' for r in results)} skipped")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=2)
    return 1 if failed else 0
