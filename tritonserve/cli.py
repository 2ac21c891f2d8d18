"""The `tritonserve` command (setup.py's console script; `python -m tritonserve` too):

    tritonserve serve [MODEL] [server options]     the HTTP server (python -m tritonserve.server)
    tritonserve generate --prompt TEXT [...]       offline generation
    tritonserve bench {throughput,profile,serve,conformance,kernels,...} [...]
    tritonserve build-ops [--rebuild]              build the CPU C++ library now

Each subcommand hands its arguments to the part that owns them, whose own --help lists its
options: nothing here repeats a default."""
from __future__ import annotations

import sys

USAGE = __doc__.split("\n\n")[1]


def serve(argv: list[str]) -> int:
    from tritonserve.server.__main__ import main
    if argv and not argv[0].startswith("-"):  # `tritonserve serve MODEL`, as `vllm serve MODEL`
        argv = ["--model", argv[0], *argv[1:]]
    return main(argv)


def generate(argv: list[str]) -> int:
    from tritonserve.engine.__main__ import main
    return main(["generate", *argv])


def bench(argv: list[str]) -> int:
    from tritonserve.bench.__main__ import main
    return main(argv)


def build_ops(argv: list[str]) -> int:
    from tritonserve.kernels.cpu import main
    return main(argv)


COMMANDS = {"serve": serve, "generate": generate, "bench": bench, "build-ops": build_ops}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage:\n{USAGE}", file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] == "--version":
        from tritonserve import __version__
        print(__version__)
        return 0
    command = COMMANDS.get(argv[0])
    if command is None:
        print(f"tritonserve: unknown command {argv[0]!r}\nusage:\n{USAGE}", file=sys.stderr)
        return 2
    return command(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
