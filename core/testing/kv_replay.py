"""Helpers of the KV tier and connector tests: replay prompts one at a time, and check that an
engine's block books balance once its requests are done."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["replay", "check_books"]


def replay(llm: Any, prompts: Sequence[list[int]], params: Any, rounds: int = 2) -> tuple[list[list[int]], list[int]]:
    """Each prompt alone, round-robin, `rounds` times: (token ids, cached tokens) per request."""
    tokens, cached = [], []
    for _ in range(rounds):
        for p in prompts:
            out = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
            tokens.append(list(out.outputs[0].token_ids))
            cached.append(out.num_cached_tokens)
    return tokens, cached


def check_books(llm: Any) -> dict[str, float]:
    """No block in use or held for a load, the scheduler's and the connector's books consistent;
    returns the engine's KV transfer counters."""
    sched = llm.engine.scheduler
    assert llm.engine.stats().num_used_blocks == 0
    sched.check_integrity()
    assert not sched.kv.external_holds
    if sched.kv_loads.connector is not None:
        sched.kv_loads.connector.check_integrity()
    return llm.engine.stats().kv_transfer
