"""Pooling models: one vector per request from the final hidden states of its prompt tokens.

A prompt may be computed over several steps (chunked prefill): `Pooler.step` takes each step's
chunk of every request and keeps what the pooling type needs across chunks (the first token's
state for cls, a running fp32 sum for mean, a running maximum for max); the pooled states of the
prompts whose last token is computed in the step go through the model's head together
(`portside.pooling.head.PoolingHead`: Dense layers and normalisation, or the classifier), and
their vectors come out in that step. A request the runner forgets (finished, aborted, preempted: it is then
recomputed from its first token) is forgotten here too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from portside.config import PoolerConfig
from portside.pooling.head import PoolingHead


@dataclass
class PoolChunk:
    """One request's rows in a step: hidden rows [row, row + n) are its tokens [start, start + n)."""

    req_id: str
    row: int
    n: int
    start: int
    prompt_len: int


class Pooler:
    def __init__(self, config: PoolerConfig, head: PoolingHead | None = None) -> None:
        """`head`: what the pooled states go through (None: L2-normalised when `config.normalize`)."""
        self.config = config
        self.head = head
        self._partial: dict[str, torch.Tensor] = {}  # req_id -> cls state, running sum or maximum (fp32)

    def forget(self, req_id: str) -> None:
        self._partial.pop(req_id, None)

    def step(self, hidden: torch.Tensor, chunks: list[PoolChunk]) -> dict[str, list[float]]:
        """The pooled vectors of the requests whose prompt ends in this step ([hidden] floats each)."""
        kind = self.config.pooling_type
        done: list[tuple[str, torch.Tensor]] = []
        for c in chunks:
            rows = hidden[c.row : c.row + c.n].float()
            if kind == "mean":
                acc = self._partial.get(c.req_id)
                total = rows.sum(dim=0) if acc is None else acc + rows.sum(dim=0)
                self._partial[c.req_id] = total
            elif kind == "max":
                acc = self._partial.get(c.req_id)
                top = rows.amax(dim=0)
                self._partial[c.req_id] = top if acc is None else torch.maximum(acc, top)
            elif kind == "cls" and c.start == 0:
                self._partial[c.req_id] = rows[0].clone()
            if c.start + c.n < c.prompt_len:
                continue
            if kind == "last":
                vec = rows[-1]
            elif kind == "mean":
                vec = self._partial.pop(c.req_id) / c.prompt_len
            else:
                vec = self._partial.pop(c.req_id)
            done.append((c.req_id, vec))
        if not done:
            return {}
        vectors = torch.stack([v for _, v in done])
        if self.head is not None:
            vectors = self.head(vectors)
        elif self.config.normalize:
            vectors = torch.nn.functional.normalize(vectors, p=2.0, dim=-1)
        return {rid: row for (rid, _), row in zip(done, vectors.cpu().tolist())}
