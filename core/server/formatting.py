"""Pieces of OpenAI response bodies that the generate endpoints share: logprobs (chat's, the
legacy completions', vLLM's prompt logprobs), usage, finish reasons, and what a streamed choice
has sent so far."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from portside.outputs import CompletionOutput, Logprob, PromptLogprobs
from portside.server.context import ServingContext

LOGPROB_FLOOR = -9999.0  # what -inf reads as (JSON has no infinity)


@dataclass
class ChoiceCursor:
    """What has been sent of one streamed choice so far (its outputs are deltas)."""

    text_len: int = 0
    num_tokens: int = 0
    echo_len: int = 0  # completions with echo: the prompt text sent before the output
    finished: bool = False
    started: bool = False

    def advance(self, c: CompletionOutput) -> None:
        self.text_len += len(c.text)
        self.num_tokens += len(c.token_ids)


def floor(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def top_entries(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k most likely alternatives of one position, most likely first."""
    ranked = sorted(entry.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30, -kv[1].logprob))
    return ranked[:k]


def top_texts(ctx: ServingContext, entry: dict[int, Logprob], k: int) -> dict[str, float]:
    """The legacy completions' `top_logprobs` of one position: {token text: logprob}, the most
    likely first (on a text collision it wins)."""
    top: dict[str, float] = {}
    for i, alt in top_entries(entry, k):
        top.setdefault(ctx.decode_token(i, alt), floor(alt.logprob))
    return top


def _positions(ctx: ServingContext, c: CompletionOutput) -> Iterator[tuple[str, Logprob | None, dict[int, Logprob]]]:
    """(token text, the token's Logprob, the position's alternatives) of each of c's tokens."""
    for pos, tid in enumerate(c.token_ids):
        entry = c.logprobs[pos] if c.logprobs and pos < len(c.logprobs) else {}
        lp = entry.get(tid)
        yield ctx.decode_token(tid, lp), lp, entry


def chat_logprobs(ctx: ServingContext, c: CompletionOutput, k: int) -> list[dict[str, Any]]:
    """Chat `logprobs.content` entries for c's tokens."""
    items = []
    for token, lp, entry in _positions(ctx, c):
        items.append(
            {
                "token": token,
                "logprob": floor(lp.logprob) if lp else LOGPROB_FLOOR,
                "bytes": list(token.encode("utf-8")),
                "top_logprobs": [
                    {"token": (t := ctx.decode_token(i, alt)), "logprob": floor(alt.logprob), "bytes": list(t.encode("utf-8"))}
                    for i, alt in top_entries(entry, k)
                ],
            }
        )
    return items


def completion_logprobs(ctx: ServingContext, c: CompletionOutput, k: int, text_offset: int) -> dict[str, Any]:
    """Legacy completions `logprobs` for c's tokens; offsets start at text_offset."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = text_offset
    for token, lp, entry in _positions(ctx, c):
        tokens.append(token)
        token_logprobs.append(floor(lp.logprob) if lp else LOGPROB_FLOOR)
        tops.append(top_texts(ctx, entry, k))
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs_json(ctx: ServingContext, pl: PromptLogprobs | None) -> list[dict[int, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs` response field: None for the first prompt token, then per token
    id (the prompt token and its top-k) {logprob, rank, decoded_token}; -inf reads -9999.0."""
    if pl is None:
        return None
    return [None if entry is None else {
        tid: {"logprob": floor(lp.logprob), "rank": lp.rank, "decoded_token": ctx.decode_token(tid, lp)}
        for tid, lp in entry.items()
    } for entry in pl]  # fmt: skip


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def openai_finish_reason(reason: str | None) -> str | None:
    """Engine finish reasons as OpenAI's ("abort" never reaches a client that is still there)."""
    if reason is None:
        return None
    return "length" if reason == "length" else "stop"
