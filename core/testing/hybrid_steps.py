"""Hand-built steps of a hybrid model for tests: two sequences through a model with a private paged
KV cache (the reference attention backend, interleaved blocks) and recurrent state slots, the
`ForwardContext` and `RecurrentMetadata` built as the model runner builds them. The slots start as
garbage: a request without an initial state must not read its slot."""

from __future__ import annotations

from typing import Any

import torch

from portside.attention.reference import ReferenceAttentionBackend
from portside.contract import ForwardContext, RecurrentMetadata
from portside.runner.inputs import attention_metadata

__all__ = ["HandSteps"]


class HandSteps:
    """Sequences 0 and 1 of `model`, in state slots `state_slots` of `num_slots` (+ scratch)."""

    def __init__(self, model: Any, block_size: int = 4, num_blocks: int = 64, num_slots: int = 4,
                 state_slots: tuple[int, int] = (1, 3)) -> None:
        self.model, self.backend, self.bs = model, ReferenceAttentionBackend(), block_size
        spec, state = model.kv_cache_spec(), model.state_spec()
        shape = self.backend.cache_shape(num_blocks, block_size, spec.num_kv_heads, spec.head_size, spec.dtype)
        self.kv = [torch.zeros(shape, dtype=spec.dtype) for _ in range(spec.num_layers)]
        gen = torch.Generator().manual_seed(0)
        self.states = [tuple(torch.randn(num_slots + 1, *s, generator=gen).to(d)
                             for s, d in zip(state.shapes, state.dtypes, strict=True)) for _ in range(state.num_layers)]
        self.tables = [list(range(s, num_blocks, 2)) for s in range(2)]  # two sequences, interleaved blocks
        self.slot_of = state_slots
        self.done = [0, 0]

    @torch.no_grad()
    def step(self, chunks: list[tuple[int, list[int]]]) -> torch.Tensor:
        """Compute each (sequence, tokens) after its earlier tokens (the one-token continuations
        first); the fp32 logits of every row."""
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qsl, lens = [0], []
        for s, toks in chunks:
            start = self.done[s]
            ids += toks
            pos += range(start, start + len(toks))
            slots += [self.tables[s][p // self.bs] * self.bs + p % self.bs for p in range(start, start + len(toks))]
            qsl.append(qsl[-1] + len(toks))
            lens.append(start + len(toks))
        decodes = sum(1 for s, toks in chunks if len(toks) == 1 and self.done[s] > 0)
        meta = self.backend.prepare(attention_metadata([self.tables[s] for s, _ in chunks], slots, qsl, lens, decodes,
                                                       self.bs, torch.device("cpu")))
        init = [self.done[s] > 0 for s, _ in chunks]
        state_slots = [self.slot_of[s] for s, _ in chunks]
        rmd = RecurrentMetadata(state_slots=torch.tensor(state_slots), has_initial_state=torch.tensor(init),
                                query_start_loc=torch.tensor(qsl, dtype=torch.int32), query_start_loc_cpu=qsl,
                                state_slots_cpu=state_slots, has_initial_state_cpu=init, num_decodes=decodes)
        ctx = ForwardContext(self.backend, self.kv, meta, state_caches=self.states, recurrent=rmd)
        hidden = self.model(torch.tensor(ids), torch.tensor(pos), ctx)
        for s, toks in chunks:
            self.done[s] += len(toks)
        return self.model.compute_logits(hidden)
