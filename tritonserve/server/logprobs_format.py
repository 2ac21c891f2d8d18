"""Logprobs as each dialect writes them: OpenAI's legacy completions object (tokens,
token_logprobs, top_logprobs; echo puts the prompt's entries first, the first one null, which
is what lm-eval's loglikelihood requests read), chat's `content` list, and vLLM's
`prompt_logprobs` list ({token id: {logprob, rank, decoded_token}} per prompt token).
`piece` turns one token id into its text (PromptTokenizer.decode_token).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from tritonserve.engine import PromptLogprob, TokenOutput

Piece = Callable[[int], str]
PromptEntries = Sequence[PromptLogprob | None]


def completion_logprobs(piece: Piece, tokens: Sequence[TokenOutput],
                        prompt_ids: Sequence[int] = (),
                        prompt: PromptEntries = ()) -> dict:
    """The legacy object over the prompt's entries (echo) then the output tokens."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    for token_id, entry in zip(prompt_ids, prompt):
        out["tokens"].append(piece(token_id))
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(entry.logprob)
        top = {piece(a.token_id): a.logprob for a in entry.top_logprobs}
        if top:  # the prompt token itself too (vLLM's), so a caller can compare it
            top.setdefault(piece(entry.token_id), entry.logprob)
        out["top_logprobs"].append(top)
    for t in tokens:
        out["tokens"].append(piece(t.token_id))
        out["token_logprobs"].append(t.logprob)
        out["top_logprobs"].append({piece(a.token_id): a.logprob for a in t.top_logprobs or ()})
    return out


def chat_logprobs(piece: Piece, tokens: Sequence[TokenOutput]) -> dict:
    return {"content": [{"token": piece(t.token_id), "logprob": t.logprob,
                         "top_logprobs": [{"token": piece(a.token_id), "logprob": a.logprob}
                                          for a in t.top_logprobs or ()]}
                        for t in tokens]}


def prompt_logprobs(piece: Piece, entries: PromptEntries) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token, null for the first, else the token's own
    entry and its top-N alternatives."""
    out: list[dict | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        ranked = {a.token_id: (a.logprob, rank) for rank, a in
                  enumerate(entry.top_logprobs, start=1)}
        ranked.setdefault(entry.token_id, (entry.logprob, entry.rank))
        out.append({str(token_id): {"logprob": lp, "rank": rank,
                                    "decoded_token": piece(token_id)}
                    for token_id, (lp, rank) in ranked.items()})
    return out
