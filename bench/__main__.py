"""python -m bench {throughput,profile,kernels,serve,conformance,grammar,loading,
    engine-check,compile-probe,cpu-decode,cpu-linear} ..."""
from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "throughput": "bench.throughput",
    "profile": "bench.profile_step",
    "kernels": "bench.kernels",
    "serve": "bench.serve",
    "conformance": "bench.conformance",
    "grammar": "bench.grammar",
    "loading": "bench.loading",
    "engine-check": "bench.engine_check",
    "compile-probe": "bench.compile_probe",
    "cpu-decode": "bench.cpu_decode",
    "cpu-linear": "bench.cpu_linear",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m bench {{{','.join(COMMANDS)}}} [options]", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[argv[0]])
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
