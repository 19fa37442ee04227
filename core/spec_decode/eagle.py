"""EAGLE and EAGLE-3 proposals: one decoder layer (`portside.model.eagle.EagleHead`) drafts k
tokens greedily from the target's hidden states of the same steps, no second target forward.

Row i of the head takes the target's hidden state at position i (EAGLE: the final, normed one
the runner returns; EAGLE-3: the residual streams entering three target layers, which the target
returns from the same forward, `AuxGraphRunner`, fused by the head's ``fc``) with the token at
position i + 1, writes its K/V at position i's slot and predicts the token at i + 2. After each
target step (`observe`) the proposer keeps the hidden states of the positions the target kept
(the last token and the accepted proposals, or a prompt chunk); `propose` runs the head over
every row whose next token is known (catching up a chunked prompt in the same steps), takes the
last row's greedy token as the first proposal, then chains k - 1 one-row steps that feed the
head's own output back as the hidden state. Proposals are deterministic, so the runner's
acceptance rule keeps the target's distribution (`runner.sampling.accepted_tokens`).

The head's KV cache is its own one-layer tensors indexed by the target's block tables (freed with
the request's blocks). Positions the target took from the prefix cache (or a request resumed
after preemption) have no fresh hidden states here: the head's K/V there is whatever the blocks
hold from the request that computed them, as vLLM does; that can only lower acceptance, never
change a token (every proposal is verified).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

from portside.contract import EagerGraphRunner, ForwardContext, GraphRunner, KVCacheSpec, Platform
from portside.model.decoder import TP, DecoderForCausalLM
from portside.model.eagle import EagleHead, EagleHeadConfig
from portside.model.qwen3_next import Qwen3NextForCausalLM
from portside.runner.inputs import BatchInputs, CachedRequestState
from portside.runner.kv_cache import allocate_kv_caches
from portside.spec_decode.mtp import MTPHead
from portside.spec_decode.qwen3_next_mtp import Qwen3NextMTPHead
from portside.spec_decode.rows import pack_rows, proposal_room

if TYPE_CHECKING:
    from portside.config import EngineConfig
    from portside.sched.output import SchedulerOutput

__all__ = ["AuxGraphRunner", "EagleProposer"]

logger = logging.getLogger(__name__)


class AuxGraphRunner(EagerGraphRunner):
    """The target op by op, keeping the auxiliary hidden states an EAGLE-3 head reads
    (`DecoderForCausalLM.forward_with_aux`) of the last step in `aux` [T, 3 * hidden]; in the
    platform's runner's `eager_mode` (`inner`), whose LM head it uses (it captures nothing: a
    captured graph of the target would not return the aux states)."""

    name = "eager+aux"

    def __init__(self, model: Any, config: EngineConfig, layers: tuple[int, ...]) -> None:
        super().__init__(model, config)
        self.layers = layers
        self.aux: torch.Tensor | None = None
        self.inner: GraphRunner = EagerGraphRunner(model, config)

    def eager_mode(self, rows: int) -> contextlib.AbstractContextManager[Any]:
        return self.inner.eager_mode(rows)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        with self.inner.eager_mode(input_ids.shape[0]):
            hidden, self.aux = self.model_fn.forward_with_aux(input_ids, positions, ctx, self.layers)  # type: ignore[attr-defined]
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.inner.compute_logits(hidden)


@dataclass
class _Rows:
    state: CachedRequestState
    valid: int = 0  # leading positions whose head K/V is the sequence's
    pending: list[torch.Tensor] = field(default_factory=list)  # target hidden rows from position `valid` on

    @property
    def num_pending(self) -> int:
        return sum(t.shape[0] for t in self.pending)


class EagleProposer:
    """The proposer for methods "eagle", "eagle3" and "mtp" (the model runner's `draft`)."""

    def __init__(self, config: EngineConfig, platform: type[Platform], target: Any, device: torch.device,
                 attn_backend: Any, block_size: int, requests: dict[str, CachedRequestState]) -> None:
        """`target`: the target model (a `DecoderForCausalLM`: its layers' TP group shards the head
        alike); `requests`: the runner's request states."""
        spec = config.speculative
        assert spec is not None
        self.k = spec.num_speculative_tokens
        self.platform, self.device, self.attn_backend, self.block_size = platform, device, attn_backend, block_size
        self.max_model_len = config.model.max_model_len
        self.requests = requests  # the runner's: a request's current state (a preempted one comes back anew)
        self.aux_runner: AuxGraphRunner | None = None
        self.runner: GraphRunner = EagerGraphRunner(target, config)  # the platform's (`use_runner`)
        self.head: EagleHead | MTPHead | Qwen3NextMTPHead
        if spec.method == "mtp":  # the target's own MTP layer
            if config.model.quantization is not None:
                raise ValueError("speculative_config: method 'mtp' with a quantized checkpoint is not supported yet")
            qwen3_next = isinstance(target, Qwen3NextForCausalLM)  # ``mtp.*``, else ``model.layers.{L}.*``
            with torch.device(device):
                self.head = Qwen3NextMTPHead(target) if qwen3_next else MTPHead(target)
            where = "the checkpoint's MTP layer " + ("(mtp.layers.0)" if qwen3_next else f"(layer {target.config.num_layers})")
        else:
            cfg: EagleHeadConfig = spec.head
            if cfg.method == "eagle3" and type(target).forward is not DecoderForCausalLM.forward:
                raise ValueError(f"speculative_config: method 'eagle3' reads auxiliary hidden states, which "
                                 f"{target.config.architecture} does not return; use method 'eagle' or 'draft_model'")
            with torch.device(device):
                self.head = EagleHead(cfg, cast(TP, target.tp), target.dtype)
            self.head.load(target)
            if cfg.method == "eagle3":
                self.aux_runner = AuxGraphRunner(target, config, cfg.aux_layer_ids)
            where = f"head {cfg.path}" + (f", auxiliary hidden states of target layers {list(cfg.aux_layer_ids)}"
                                          if self.aux_runner else "")
        self.head.eval()
        platform.prepare_model(self.head, config)  # the platform's weight layout (the cpu backend: huge pages)
        self.kv_caches: list[torch.Tensor] = []
        self.rows: dict[str, _Rows] = {}
        logger.info("speculative decoding: %s, %s, %d tokens a step", spec.method, where, self.k)

    def use_runner(self, runner: GraphRunner) -> GraphRunner:
        """Take the platform's graph runner of the target (the head runs in its `eager_mode`);
        the runner the target's steps go through: EAGLE-3's `aux_runner` around it, else it."""
        self.runner = runner
        if self.aux_runner is None:
            return runner
        self.aux_runner.inner = runner
        return self.aux_runner

    # ---- KV cache (the target's block ids, the head's own one-layer tensors) ----------------

    def kv_cache_spec(self) -> KVCacheSpec:
        return self.head.kv_cache_spec()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_caches(self.attn_backend, self.kv_cache_spec(), num_blocks, self.block_size, self.device)

    def forget(self, req_id: str) -> None:
        self.rows.pop(req_id, None)

    # ---- the target's hidden states of each step ---------------------------------------------

    def observe(self, so: SchedulerOutput, batch: BatchInputs, hidden: torch.Tensor, sampled: dict[str, list[int]]) -> None:
        """Keep the hidden states of the positions the target kept this step (call before the
        runner advances its computed counts)."""
        source: torch.Tensor | None = hidden
        if self.aux_runner is not None:
            source, self.aux_runner.aux = self.aux_runner.aux, None
            if source is None or source.shape[0] != hidden.shape[0]:  # a step the aux runner did not run
                self.rows.clear()
                return
        qsl = batch.metadata.query_start_loc_cpu
        for i, rid in enumerate(batch.req_ids):
            state = self.requests[rid]
            start, n = state.num_computed_tokens, so.num_scheduled_tokens[rid]
            if rid in so.scheduled_spec_decode_tokens:
                n = len(sampled[rid])  # the last token's row and the accepted proposals'
            r = self.rows.get(rid)
            if r is None or r.state is not state or r.valid + r.num_pending != start:
                r = self.rows[rid] = _Rows(state, valid=start)  # new, resumed or after a prefix hit
            r.pending.append(cast(torch.Tensor, source)[int(qsl[i]) : int(qsl[i]) + n].clone())

    # ---- proposals ----------------------------------------------------------------------------

    def propose(self, states: list[CachedRequestState]) -> dict[str, list[int]]:
        """Catch every request up on the hidden states kept so far; up to k greedy proposals for
        each of `states` (fewer near max_model_len, its max_tokens or the end of its slots)."""
        wanted = {s.req_id: self._room(s) for s in states}
        rows, draw = [], []
        for rid, r in list(self.rows.items()):
            if self.requests.get(rid) is not r.state:
                del self.rows[rid]
                continue
            m = min(r.num_pending, r.state.num_tokens - 1 - r.valid)
            if m <= 0:
                continue
            pending = torch.cat(r.pending)
            rows.append((r.state, r.valid, r.state.token_slice(r.valid + 1, r.valid + 1 + m), pending[:m]))
            r.valid += m
            r.pending = [pending[m:]] if m < pending.shape[0] else []
            draw.append(r.valid == r.state.num_tokens - 1 and wanted.get(rid, 0) > 0)
        if not rows:
            return {}
        proposals: dict[str, list[int]] = {}
        with self.platform.inference_mode():
            if self.aux_runner is not None:
                with self.runner.eager_mode(sum(len(t) for _, _, t, _ in rows)):
                    rows = [(s, p, t, self.head.combine(h)) for s, p, t, h in rows]
            out, nxt = self._forward(rows)
            chain = [(row[0], o, h) for row, o, h, d in zip(rows, out, nxt, draw) if d]
            if not chain:
                return {}
            tokens = self._draft_tokens([o for _, o, _ in chain])
            for (state, _, _), t in zip(chain, tokens):
                proposals[state.req_id] = [t]
            for step in range(1, self.k):
                chain = [c for c in chain if wanted[c[0].req_id] > step]
                if not chain:
                    break
                steps = [(s, s.num_tokens - 2 + step, [proposals[s.req_id][-1]], h[None]) for s, _, h in chain]
                out, nxt = self._forward(steps)
                tokens = self._draft_tokens(out)
                chain = [(s, o, h) for (s, _, _), o, h in zip(chain, out, nxt)]
                for (state, _, _), t in zip(chain, tokens):
                    proposals[state.req_id].append(t)
        return proposals

    def _draft_tokens(self, out: list[torch.Tensor]) -> list[int]:
        with self.runner.eager_mode(len(out)):
            return self.head.draft_tokens(torch.stack(out)).tolist()

    def _room(self, state: CachedRequestState) -> int:
        return proposal_room(state, self.k, self.max_model_len, self.block_size)

    def _forward(self, rows: list[tuple[CachedRequestState, int, list[int], torch.Tensor]]
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Run the head over each row (tokens from position `start`, their hidden states); per row
        its last position's (hidden for the logits, residual stream for the next chained row)."""
        packed = pack_rows(rows, self.block_size, self.device, self.attn_backend, self.kv_caches)
        hidden = torch.cat([rows[i][3] for i in packed.order]).to(self.head.dtype)
        with self.runner.eager_mode(packed.ids.shape[0]):
            out, nxt = self.head(packed.ids, packed.positions, hidden, packed.ctx)
        last: list[int] = [0] * len(rows)
        for j, i in enumerate(packed.order):
            last[i] = packed.last_index(j)
        return [cast(torch.Tensor, out[x]) for x in last], [cast(torch.Tensor, nxt[x]) for x in last]
