"""Draft-model proposals: a small model with the target's vocabulary proposes k tokens greedily.

The draft runs on the target's platform, in the same process and tensor-parallel group (sharded
as the target is, so every rank runs it in step and draws the same proposals), through the same
attention backend. Its KV cache is its own tensors indexed by the target's block tables: a
request's block ids hold the target's KV in the target's cache and the draft's in the draft's,
and the scheduler gives a request that samples `k` lookahead slots for the KV of the proposals
the draft makes after the step's new token.

Per request the proposer remembers how many leading positions of its cache are the sequence's
(`_Draft.valid`) and the proposals whose KV it wrote after them (`_Draft.ahead`). After a step
the accepted proposals among those are kept and the rest of the sequence (the step's new token,
or after admission the whole prompt, in chunks of the token budget) is computed again; then
k - 1 one-token forwards extend the proposal. A draft is deterministic (greedy), so the runner's
acceptance rule keeps the target's distribution exactly. Nothing here depends on blocks shared
through the prefix cache holding draft KV: a request's draft cache starts empty at admission
(and after preemption), so a prefix hit only saves the target's work.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

from portside.contract import KVCacheSpec, Platform
from portside.model.registry import load_model
from portside.runner.inputs import CachedRequestState
from portside.runner.kv_cache import allocate_kv_caches, check_attention_features, dummy_decode_context
from portside.runner.recurrent import state_spec_of
from portside.spec_decode.rows import pack_rows, proposal_room

if TYPE_CHECKING:
    from portside.config import EngineConfig

logger = logging.getLogger(__name__)


@dataclass
class _Draft:
    valid: int = 0  # leading positions whose draft KV is the sequence's
    ahead: list[int] = field(default_factory=list)  # proposals whose KV follows `valid` (all but the last)


class DraftModelProposer:
    def __init__(self, config: EngineConfig, platform: type[Platform], comm: Any, device: torch.device, rank: int,
                 attn_backend: Any, block_size: int, target_vocab_size: int) -> None:
        spec = config.speculative
        assert spec is not None and spec.draft is not None
        self.k = spec.num_speculative_tokens
        self.platform = platform
        self.device = device
        self.attn_backend = attn_backend
        self.block_size = block_size
        self.max_model_len = config.model.max_model_len
        self.max_batched_tokens = config.scheduler.max_num_batched_tokens
        draft_config = dataclasses.replace(config, model=spec.draft, lora=None)
        tp = config.parallel.tensor_parallel_size
        self.model = load_model(spec.draft, device, comm, tp_rank=rank, tp_size=tp, ops=platform.model_ops(draft_config))
        platform.prepare_model(cast(torch.nn.Module, self.model), draft_config)
        if self.model.config.vocab_size != target_vocab_size:  # a .gguf's vocabulary is only known once loaded
            raise ValueError(f"speculative_config: the draft model's vocabulary ({self.model.config.vocab_size} tokens) "
                             f"is not the target's ({target_vocab_size}); a draft must share the target's tokenizer")
        if state_spec_of(self.model) is not None:  # its states would need the target's roll back, per draft step
            raise ValueError(f"speculative_config: the draft model {self.model.config.architecture} has recurrent "
                             "layers, which a draft model may not have; use a draft with attention layers only")
        check_attention_features(self.model, platform, attn_backend)
        self.graph_runner = platform.graph_runner(self.model, draft_config)
        self.kv_caches: list[torch.Tensor] = []
        self.scratch_block = -1
        self.requests: dict[str, _Draft] = {}
        logger.info("speculative decoding: draft model %s (%d layers), %d tokens a step", spec.draft.path,
                    self.model.config.num_layers, self.k)

    # ---- KV cache (the target's block ids, the draft's own tensors) -------------------------

    def kv_cache_spec(self) -> KVCacheSpec:
        return self.model.kv_cache_spec()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_caches(self.attn_backend, self.kv_cache_spec(), num_blocks, self.block_size, self.device)
        self.scratch_block = num_blocks
        with self.platform.inference_mode():
            self.graph_runner.capture(lambda n: dummy_decode_context(self.attn_backend, self.kv_caches, self.scratch_block,
                                                                     self.block_size, self.device, n))

    def forget(self, req_id: str) -> None:
        self.requests.pop(req_id, None)

    # ---- proposals --------------------------------------------------------------------------

    def propose(self, states: list[CachedRequestState]) -> dict[str, list[int]]:
        """Up to k greedy proposals for each request (fewer near max_model_len, its max_tokens or
        the end of its allocated slots)."""
        bs = self.block_size
        todo: list[tuple[CachedRequestState, _Draft, int]] = []  # (state, its draft, proposals to make)
        for state in states:
            n = state.num_tokens
            room = proposal_room(state, self.k, self.max_model_len, bs)
            if room <= 0:
                continue
            draft = self.requests.setdefault(state.req_id, _Draft())
            actual = state.token_slice(draft.valid, min(draft.valid + len(draft.ahead), n))
            kept = 0  # proposals written last time that the sequence accepted
            while kept < len(actual) and draft.ahead[kept] == actual[kept]:
                kept += 1
            draft.valid = min(draft.valid + kept, n - 1)  # the last token always runs: its logits propose
            draft.ahead = []
            todo.append((state, draft, room))
        if not todo:
            return {}
        proposals: dict[str, list[int]] = {s.req_id: [] for s, _, _ in todo}
        with self.platform.inference_mode():
            # catch up to each sequence's last token (in chunks of the token budget), drawing the first proposal
            pending = list(todo)
            while pending:
                budget, rows, later = self.max_batched_tokens, [], []
                for state, draft, room in pending:
                    n = min(state.num_tokens - draft.valid, budget)
                    if n <= 0:
                        later.append((state, draft, room))
                        continue
                    rows.append((state, draft.valid, state.token_slice(draft.valid, draft.valid + n)))
                    budget -= n
                    draft.valid += n
                    if draft.valid < state.num_tokens:
                        later.append((state, draft, room))
                drawn = self._forward(rows)
                for (state, _, _), token in zip(rows, drawn):
                    if token is not None:
                        proposals[state.req_id].append(token)
                pending = later
            # then one token at a time
            for step in range(1, max(room for _, _, room in todo)):
                rows = [(state, state.num_tokens + step - 1, [proposals[state.req_id][-1]])
                        for state, _, room in todo if room > step]
                for (state, _, _), token in zip(rows, self._forward(rows)):
                    proposals[state.req_id].append(cast(int, token))
        for state, draft, _ in todo:
            draft.ahead = proposals[state.req_id][:-1]
        return proposals

    def _forward(self, rows: list[tuple[CachedRequestState, int, list[int]]]) -> list[int | None]:
        """Run the draft over each row's tokens (written from position `start`); the greedy next
        token of each row that ends at or past its sequence's last token, else None."""
        packed = pack_rows(rows, self.block_size, self.device, self.attn_backend, self.kv_caches)
        hidden = self.graph_runner(packed.ids, packed.positions, packed.ctx)
        samples = [j for j, i in enumerate(packed.order) if rows[i][1] + len(rows[i][2]) >= rows[i][0].num_tokens]
        drawn: list[int | None] = [None] * len(rows)
        if samples:
            last = torch.tensor([packed.last_index(j) for j in samples], dtype=torch.int64, device=self.device)
            tokens = self.graph_runner.logits(hidden, last).argmax(dim=-1).tolist()
            for j, token in zip(samples, tokens):
                drawn[packed.order[j]] = token
        return drawn

