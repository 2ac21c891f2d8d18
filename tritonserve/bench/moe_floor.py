"""python -m tritonserve.bench.moe_floor FILE.gguf [--read-gbps R]: the bytes one decode token
of a GGUF file's model reads, counted from its tensors: every expert tensor (ffn_*_exps) at
top_k / experts of its size (a token's chosen experts), everything else whole (attention, the
routers, norms, the output layer) but the embedding table, of which one row is read. At R GB/s
(bench/cpu_decode.read_gbps: the machine's read rate) that is the single-stream floor: the
time a token takes if it costs nothing but reading those bytes once."""
from __future__ import annotations

import argparse
import json


def token_bytes(path: str) -> dict:
    import gguf

    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    experts = reader.fields.get(f"{arch}.expert_count")
    used = reader.fields.get(f"{arch}.expert_used_count")
    share = used.contents() / experts.contents() if experts else 1.0
    counted = {"experts": 0, "other": 0, "embedding_row": 0, "file": 0}
    for t in reader.tensors:
        size = int(t.n_bytes)
        counted["file"] += size
        if t.name.endswith("_exps.weight"):
            counted["experts"] += int(size * share)
        elif t.name == "token_embd.weight":
            counted["embedding_row"] += size // int(t.shape[-1])
        else:
            counted["other"] += size
    counted["token"] = counted["experts"] + counted["other"] + counted["embedding_row"]
    counted["share_of_experts_read"] = share
    return counted


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tritonserve.bench.moe_floor")
    p.add_argument("file")
    p.add_argument("--read-gbps", type=float, default=None)
    args = p.parse_args(argv)
    counted = token_bytes(args.file)
    if args.read_gbps:
        ms = counted["token"] / (args.read_gbps * 1e9) * 1e3
        counted["floor_ms_per_token"] = round(ms, 2)
        counted["floor_tok_per_s"] = round(1e3 / ms, 1)
    print(json.dumps(counted))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
