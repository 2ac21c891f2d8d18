"""Repeatable workloads: random prompts of given token lengths (or plain words), or JSONL."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass

WORDS = ("time year people way day man thing woman life child world school state family "
         "student group country problem hand part place case week company system program "
         "question work government number night point home water room mother area money "
         "story fact month lot right study book eye job word business issue side kind head "
         "house service friend father power hour game line end member law car city").split()


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | list[int]
    output_len: int
    input_len: int  # tokens when known, else words
    text: str = ""  # the prompt as text (for the chat route)

    @property
    def as_text(self) -> str:
        return self.text or (self.prompt if isinstance(self.prompt, str) else "")


def random_requests(num: int, input_len: int, output_len: int, seed: int,
                    tokenizer=None) -> list[BenchRequest]:
    """Token-length prompts from the tokenizer's vocabulary (sent as token ids), or plain
    words when no tokenizer is given."""
    rng = random.Random(seed)
    out = []
    if tokenizer is not None:
        special = set(tokenizer.all_special_ids)
        vocab = [i for i in range(min(tokenizer.vocab_size, 50000)) if i not in special]
        vocab = vocab[len(vocab) // 10:]  # skip bytes and other fragments
        for _ in range(num):
            ids = [rng.choice(vocab) for _ in range(input_len)]
            out.append(BenchRequest(ids, output_len, input_len, tokenizer.decode(ids)))
    else:
        for _ in range(num):
            out.append(BenchRequest(" ".join(rng.choice(WORDS) for _ in range(input_len)),
                                    output_len, input_len))
    return out


def shared_prefix_requests(num: int, num_prefixes: int, prefix_len: int, input_len: int,
                           output_len: int, seed: int, tokenizer=None) -> list[BenchRequest]:
    """Agents' and chat apps' traffic: num_prefixes long "system prompts" of prefix_len tokens
    (words without a tokenizer), each request one of them, drawn at random, then a question of
    input_len. What prefix-aware data-parallel routing is for (server/router.py)."""
    rng = random.Random(seed)
    count = max(num_prefixes, 1)
    prefixes = random_requests(count, prefix_len, output_len, seed + 7919, tokenizer)
    questions = random_requests(num, input_len, output_len, seed, tokenizer)
    out = []
    for question in questions:
        prefix = prefixes[rng.randrange(count)]
        if tokenizer is not None:
            ids = list(prefix.prompt) + list(question.prompt)
            out.append(BenchRequest(ids, output_len, len(ids), prefix.text + question.text))
        else:
            out.append(BenchRequest(f"{prefix.prompt} {question.prompt}", output_len,
                                    prefix_len + input_len))
    return out


def jsonl_requests(path: str, num: int, output_len: int, seed: int) -> list[BenchRequest]:
    """Each line: {"prompt": str, "output_len"?: int}. Sampled with the seed, repeated if
    the file is shorter than --num-prompts."""
    rows = []
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                rows.append(BenchRequest(row["prompt"], int(row.get("output_len", output_len)),
                                         len(str(row["prompt"]).split())))
    if not rows:
        raise ValueError(f"{path} holds no prompts")
    rng = random.Random(seed)
    return [rows[rng.randrange(len(rows))] for _ in range(num)]


def arrival_gaps(num: int, request_rate: float | None, seed: int) -> list[float]:
    """Seconds to wait before each request: Poisson arrivals at request_rate, or none."""
    if not request_rate or request_rate == float("inf"):
        return [0.0] * num
    rng = random.Random(seed + 1)
    return [rng.expovariate(request_rate) for _ in range(num)]
