"""Continuous batching: one step's token budget spent on running requests, then waiting ones.

There is no prefill phase and decode phase. Every request has `num_computed_tokens` (KV in the
cache) and `num_tokens` (prompt + outputs); each step schedules, within the token budget, tokens
so that the first catches up with the second. A prompt is one chunk (or several, with chunked
prefill), a decode is one token, a recompute after preemption is a prefill of prompt + outputs,
and a prefix-cache hit or a fork simply starts a request with `num_computed_tokens > 0`.

Blocks run out -> preemption by recompute: the victim (policy.py) frees its blocks, goes back
to the waiting queue with `num_computed_tokens = 0`, and the runner is told to forget it.

Speculative decoding (`num_spec_tokens` > 0): a running request's proposals
(`Request.spec_token_ids`, from the runner's previous output) are scheduled after its last token
and count in the token budget; `update_from_output` takes the rejected ones back off
`num_computed_tokens` before anything is entered in the prefix cache, so their KV slots are
simply overwritten by the next step. A request may then hold one block more than its tokens
need (kept for the next step's proposals). A draft model (`num_lookahead_tokens` = k) writes the
KV of the k proposals it makes after the step's new token, so a chunk that ends a request's known
tokens also gets k lookahead slots (never past max_model_len).

Pipeline parallelism: with `num_micro_batches` = P > 1 the engine keeps up to P scheduled steps
in flight (one per stage at best). A request in flight is in no other batch and is never a
preemption victim; each batch takes at most ceil(running / P) running requests and (with
chunked prefill) 1/P of the token budget, at most `micro_batch_tokens` (the platform's default
or --pipeline-micro-batch-tokens), so the running set splits into P groups that take turns and a
burst of prompts is prefilled in overlapping steps small enough that the pipeline's fill and
drain (a stage waiting one micro-batch's time) stay short. The workers of earlier stages never see the sampled
tokens: each cached request carries the tokens appended since it was last scheduled
(`send_token_ids`).

Sliding window (`sliding_window`: the window of a model whose every layer has the same one):
after each step a request's blocks wholly out of the window are freed (`KVCacheManager.
free_out_of_window_blocks`), so a request holds about (W + chunk) / block_size blocks at a time
however long it grows. Its table keeps null placeholders for them; the runner, which only ever
receives a table's new entries after admission, keeps the old ids, read only under the mask.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from portside.kv_cache.manager import KVCacheManager, cdiv
from portside.outputs import SpecDecodeStats
from portside.request import Request, RequestStatus
from portside.sched.kv_loads import KVConnectorScheduler, KVLoads
from portside.sched.output import ModelRunnerOutput, SchedulerOutput
from portside.sched.policy import make_policy
from portside.sched.request_queue import WaitingQueue
from portside.sched.runner_view import RunnerView

if TYPE_CHECKING:  # portside.config imports torch (for dtypes); the scheduler must not
    from portside.config import SchedulerConfig


@dataclass
class SchedulerStats:
    """The scheduler's state and counters at one moment (`Scheduler.make_stats`)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks in use
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # of which found in the cache
    num_preemptions: int
    spec_decode: SpecDecodeStats  # every request's proposals and acceptances since start
    kv_transfer: dict[str, float]  # KV tiers / connector counters, tokens recomputed after preemption (`KVLoads.stats`)


class Scheduler:
    """Decides, once per step, which tokens of which requests the model runner computes."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        block_size: int,
        num_blocks: int,
        enable_prefix_caching: bool,
        max_model_len: int,
        sliding_window: int | None = None,
        max_loras: int = 0,
        num_spec_tokens: int = 0,
        num_lookahead_tokens: int = 0,
        num_micro_batches: int = 1,
        micro_batch_tokens: int | None = None,
        send_token_ids: bool = False,
        max_encoder_tokens: int | None = None,
        num_state_slots: int = 0,
        kv_connector: KVConnectorScheduler | None = None,
    ) -> None:
        self.config = scheduler_config
        # image embedding rows encoded per step (None: the token budget); see _fit_encoder_budget
        self.max_encoder_tokens = max_encoder_tokens
        self._encoder_budget = self._encoder_step_budget = 0
        self.num_spec_tokens = num_spec_tokens  # proposals per request and step (0: no speculation)
        self.num_lookahead_tokens = num_lookahead_tokens  # KV slots past a step's tokens (a draft model's)
        self.max_loras = max_loras  # distinct LoRA adapters running at once (the runner's slots); 0: no LoRA
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.policy = make_policy(scheduler_config.policy)
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching, sliding_window, num_state_slots)
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting = WaitingQueue(self.policy)
        self.running: list[Request] = []  # in admission order
        self.num_preemptions = 0
        self._finished_ids: set[str] = set()  # for the next output's finished_req_ids
        self.runner_view = RunnerView(self.kv, send_token_ids)  # what the runner knows of each request
        self._in_flight: dict[str, int] = {}  # scheduled, not yet updated (several batches with num_micro_batches > 1)
        self.num_micro_batches = num_micro_batches  # scheduled steps the engine keeps in flight
        self.micro_batch_tokens = micro_batch_tokens  # cap on a micro-batch's tokens (see schedule)
        self.spec_stats = SpecDecodeStats()  # every request's proposals and acceptances since start
        self.kv_loads = KVLoads(kv_connector, self.kv)  # a KV connector's loads (tiers, disaggregation); no-ops without one

    # ---- intake ------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request. Raises ValueError for one that can never be scheduled."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if not 0 < request.num_prompt_tokens <= self.max_model_len:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens; it must have 1 to {self.max_model_len}"
            )
        if not self.config.enable_chunked_prefill and request.num_prompt_tokens > self.config.max_num_batched_tokens:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens, more than max_num_batched_tokens="
                f"{self.config.max_num_batched_tokens}; enable chunked prefill or raise the budget"
            )
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.add(request)

    # ---- one step ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Spend this step's token budget: running requests first, then waiting ones."""
        budget = self.config.max_num_batched_tokens
        if self.num_micro_batches > 1 and self.config.enable_chunked_prefill:
            # pipeline stages take turns on the batches in flight: a prefill spread over them
            # overlaps too (without chunking a prompt longer than a share would never fit); a
            # stage idles for one micro-batch while the pipeline fills and again while it
            # drains, so a burst of prompts goes in micro-batches of at most `micro_batch_tokens`
            # (never fewer than a micro-batch's share of decodes: each running request still
            # gets its token every round)
            budget = max(1, budget // self.num_micro_batches)
            if self.micro_batch_tokens is not None:
                decodes = -(-self.config.max_num_seqs // self.num_micro_batches) * (1 + self.num_spec_tokens)
                budget = min(budget, max(self.micro_batch_tokens, decodes))
        scheduled: dict[str, int] = {}  # req_id -> tokens, in batch order
        preempted: list[Request] = []
        spec: dict[str, list[int]] = {}
        self._encoder_budget = self._encoder_step_budget = \
            self.max_encoder_tokens if self.max_encoder_tokens is not None else budget
        budget = self._schedule_running(scheduled, preempted, budget, spec)
        new_reqs: list[Request] = []
        if not preempted:  # the pool is exhausted: admitting now would only thrash
            self._schedule_waiting(scheduled, new_reqs, budget)

        output = SchedulerOutput(
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
            finished_req_ids=self._finished_ids | {r.request_id for r in preempted},
            scheduled_spec_decode_tokens={rid: toks for rid, toks in spec.items() if rid in scheduled},
        )
        output.state_copies_before, output.state_copies_after = self.kv.take_state_copies()
        self._finished_ids = set()
        new_ids = {r.request_id for r in new_reqs}
        for req_id in scheduled:
            request = self.requests[req_id]
            if req_id in new_ids:
                output.scheduled_new_reqs.append(self.runner_view.new_request(request))
            else:
                output.scheduled_cached_reqs.append(self.runner_view.cached_request(request))
        self._in_flight.update(scheduled)
        output.kv_connector_metadata = self.kv_loads.build_meta(output)
        return output

    def _schedule_running(self, scheduled: dict[str, int], preempted: list[Request], budget: int,
                          spec: dict[str, list[int]]) -> int:
        """One decode token (plus its proposals, into `spec`) or the next prefill chunk for each
        running request, preempting when the pool runs dry. Returns the budget left."""
        i = 0
        seats = -(-len(self.running) // self.num_micro_batches)  # running requests this batch may take
        while i < len(self.running) and budget > 0 and seats > 0:
            request = self.running[i]
            if request.request_id in self._in_flight:
                i += 1
                continue
            num_new = min(request.num_tokens + len(request.spec_token_ids) - request.num_computed_tokens, budget)
            assert num_new > 0, f"{request} has nothing to compute: the runner sampled no token for it"
            num_new = self.kv.align_chunk(request, request.num_computed_tokens, num_new)
            if request.mm_features:
                num_new = self._fit_encoder_budget(request, request.num_computed_tokens, num_new)
                if num_new == 0:  # its next image waits for a step with encoder budget left
                    i += 1
                    continue
            lookahead = self._lookahead(request, request.num_computed_tokens + num_new)
            state_end = 0 if request.num_computed_tokens + num_new > request.num_tokens else num_new  # verifies: unknown
            waits = False
            while self.kv.allocate_slots(request, num_new + lookahead, num_state_tokens=state_end) is None:
                candidates = [r for r in self.running if r.request_id not in self._in_flight]
                if candidates == [request] and self._in_flight:
                    waits = True  # only batches in flight hold blocks to spare: wait for them, not preempt itself
                    break
                victim = self.policy.pick_victim(candidates)
                if victim.request_id in scheduled:  # undo if it was scheduled earlier
                    budget += scheduled.pop(victim.request_id)
                    seats += 1
                if self.running.index(victim) < i:
                    i -= 1
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                seats -= 1
                scheduled[request.request_id] = num_new
                num_spec = request.num_computed_tokens + num_new - request.num_tokens  # proposals that fit the budget
                if num_spec > 0:
                    spec[request.request_id] = request.spec_token_ids[:num_spec]
                budget -= num_new
                i += 1
            if waits:
                i += 1
        return budget

    def _schedule_waiting(self, scheduled: dict[str, int], new_reqs: list[Request], budget: int) -> None:
        """Admit waiting requests in policy order while budget, seats and blocks last. A child
        sample whose parent's prompt is still being computed is skipped, not waited on, and so is
        a request whose LoRA adapter would be one more than the runner has slots for."""
        loras = {r.lora_id for r in self.running if r.lora_id is not None}
        for request in self.waiting:
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                return
            parent = self._live_parent(request)
            if parent is not None and parent.num_computed_tokens < parent.num_prompt_tokens:
                continue
            lora = request.lora_id
            if lora is not None and lora not in loras and len(loras) >= self.max_loras:
                continue
            if parent is not None:
                computed_blocks, num_computed = self.kv.get_fork_blocks(parent, request)
            else:
                computed_blocks, num_computed = self.kv.get_computed_blocks(request)
                if self.kv_loads.waits(request, computed_blocks, num_computed):
                    continue  # its KV is being loaded (a connector); others run meanwhile
            num_new = self._num_new_tokens(request, num_computed, budget)
            if num_new is None:
                return
            num_new = self.kv.align_chunk(request, num_computed, num_new)
            if request.mm_features:
                num_new = self._fit_encoder_budget(request, num_computed, num_new)
                if num_new == 0:
                    return
            lookahead = self._lookahead(request, num_computed + num_new)
            if self.kv.allocate_slots(request, num_new + lookahead, computed_blocks, num_new) is None:
                # with a window the pool may be sized below max_model_len: a long prefix hit plus
                # a chunk can then need more blocks than there are. With nothing running, nothing
                # will ever free any: start over without the hit (a chunk alone always fits)
                if not (computed_blocks and self.kv.sliding_window is not None and not self.running):
                    return
                computed_blocks, num_computed = [], 0
                num_new = self._num_new_tokens(request, num_computed, budget)
                lookahead = 0 if num_new is None else self._lookahead(request, num_new)
                if num_new is None or self.kv.allocate_slots(request, num_new + lookahead, None, num_new) is None:
                    return
            self.waiting.remove(request)
            self.running.append(request)
            self.kv_loads.admitted(request, num_computed)
            if lora is not None:
                loras.add(lora)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed
            if request.first_scheduled_time is None:  # the end of its queue time (metrics)
                request.first_scheduled_time = time.monotonic()
            scheduled[request.request_id] = num_new
            new_reqs.append(request)
            budget -= num_new

    def _fit_encoder_budget(self, request: Request, start: int, num_new: int) -> int:
        """Shorten a chunk [start, start + num_new) to end before the first image it reaches
        that this step's encoder budget cannot pay for (an image is encoded whole, at the first
        chunk that reaches it; later chunks of it read the runner's encoder cache). The step's
        first image is always paid for, so an image larger than the budget still runs."""
        end = start + num_new
        for k, f in enumerate(request.mm_features):
            p = f.placeholder
            if p.end <= start or k in request.mm_encoded:
                continue
            if p.offset >= end:
                break
            cost = f.encoder_cost()
            if cost > self._encoder_budget and self._encoder_budget < self._encoder_step_budget:
                return max(0, p.offset - start)
            self._encoder_budget -= cost
            request.mm_encoded.add(k)
        return num_new

    def _lookahead(self, request: Request, end: int) -> int:
        """Slots past `end` (the computed count after this step) for a draft model's proposals:
        only when the step reaches the last known token (it samples) and the request may be speculated."""
        if not self.num_lookahead_tokens or end < request.num_tokens or request.structured is not None:
            return 0
        return max(0, min(self.num_lookahead_tokens, self.max_model_len - end))

    def _num_new_tokens(self, request: Request, num_computed: int, budget: int) -> int | None:
        """Tokens to schedule for a request admitted with `num_computed` tokens already in the
        cache, or None if it must wait for a later step."""
        num_new = request.num_tokens - num_computed
        if num_new > budget:
            # without chunked prefill a prompt waits for a step with room; only a recompute
            # longer than a whole step (prompt + outputs after preemption) is chunked anyway
            if not self.config.enable_chunked_prefill and (
                budget < self.config.max_num_batched_tokens or request.num_prompt_tokens >= num_new
            ):
                return None
            num_new = budget
        return num_new

    def _live_parent(self, request: Request) -> Request | None:
        if request.parent_id is None:
            return None
        parent = self.requests.get(request.parent_id)
        return parent if parent is not None and not parent.is_finished else None

    def _preempt(self, request: Request) -> None:
        self.kv_loads.preempted(request)
        self.kv.free(request)
        self.running.remove(request)
        self.runner_view.forget(request.request_id)
        request.spec_token_ids = []
        request.mm_encoded.clear()  # its images are charged again when it is recomputed
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)

    # ---- results -----------------------------------------------------------------------------

    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[Request]:
        """Advance each scheduled request, append its sampled tokens, check stops, free finished
        requests. Returns every request that got new tokens or finished this step."""
        touched: list[Request] = []
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted (or preempted) after it was scheduled
            request.num_computed_tokens += num_tokens
            new_tokens = runner_output.sampled_token_ids.get(req_id, [])
            spec = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            request.spec_token_ids = []
            if spec:  # the rejected proposals' KV is not the sequence's: rolled back, and the
                # accepted ones cached below, once their tokens are appended
                num_accepted = len(new_tokens) - 1
                request.num_computed_tokens -= len(spec) - num_accepted
                self._record_spec(request, len(spec), num_accepted)
            else:
                self._cache_blocks(request)
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prefill chunk short of the end samples nothing
            if request.max_tokens == 0:  # a pooling request (task embed): done once its prompt is computed
                request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, None
            for token in new_tokens:
                request.output_token_ids.append(token)
                if self._check_stop(request, token):
                    break
                if request.structured is not None and request.structured.accept(token):
                    request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, None  # output complete
                    break
            if spec:  # a stop among the accepted proposals drops the tokens after it: their KV too
                request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
                self._cache_blocks(request)
            if request.is_finished:
                self._free_finished(request)
            elif self.num_spec_tokens:
                request.spec_token_ids = self._usable_proposals(request, runner_output.spec_token_ids.get(req_id))
            if new_tokens or request.is_finished:
                touched.append(request)
        for req_id in scheduler_output.num_scheduled_tokens:
            self._in_flight.pop(req_id, None)
        self.kv_loads.update(runner_output.kv_connector_output, self.requests)
        return touched

    def forget_in_flight(self) -> None:
        """The executor failed the steps in flight: none of their requests is in flight any more."""
        self._in_flight = {}

    def _cache_blocks(self, request: Request) -> None:
        self.kv.cache_blocks(request, request.num_computed_tokens)
        self.kv.free_out_of_window_blocks(request)  # hashed just above, so still findable

    def _usable_proposals(self, request: Request, proposals: list[int] | None) -> list[int]:
        """The runner's proposals cut to what the request may still produce: the step yields one
        token more than it verifies, and every verified position needs a KV slot."""
        if not proposals or request.num_computed_tokens != request.num_tokens - 1:
            return []
        room = min(request.max_tokens - request.num_output_tokens - 1, self.max_model_len - request.num_tokens)
        kept = proposals[: max(0, min(room, self.num_spec_tokens))]  # under a grammar: the prefix it allows
        return kept if request.structured is None else request.structured.valid_drafts(kept, self.spec_stats)

    def _record_spec(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        if request.spec_stats is None:
            request.spec_stats = SpecDecodeStats()
        request.spec_stats.record(num_proposed, num_accepted)
        self.spec_stats.record(num_proposed, num_accepted)

    def _check_stop(self, request: Request, token: int) -> bool:
        """Set the finished status if `token` (just appended) ends the request. A stop token
        wins over the length limit when both apply."""
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if token == request.eos_token_id and not params.ignore_eos:
                request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, None
                return True
            if token in (params.stop_token_ids or ()):
                request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, token
                return True
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def finish_requests(self, req_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside (abort, stop string): blocks are freed at once and the
        ids reach the runner in the next output. Unknown or finished ids are ignored."""
        assert status.finished, status
        for req_id in [req_ids] if isinstance(req_ids, str) else req_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if request.status != RequestStatus.RUNNING:
                self.waiting.remove(request)
            request.status = status
            self._free_finished(request)

    def _free_finished(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        self.kv.cache_blocks(request, request.num_computed_tokens)
        self.kv_loads.finished(request)
        self.kv.free(request)
        del self.requests[request.request_id]
        self.runner_view.forget(request.request_id)
        self._in_flight.pop(request.request_id, None)
        self._finished_ids.add(request.request_id)

    # ---- state and stats ---------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or self.kv_loads.has_pending_work()

    def get_request(self, req_id: str) -> Request | None:
        return self.requests.get(req_id)

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=self.kv.prefix_cache_stats.queries,
            prefix_cache_hits=self.kv.prefix_cache_stats.hits,
            num_preemptions=self.num_preemptions,
            spec_decode=self.spec_stats,
            kv_transfer=self.kv_loads.stats(),
        )

    def check_integrity(self) -> None:
        """Assert the scheduler's and the KV-cache manager's invariants."""
        self.kv.check_integrity()
        waiting = list(self.waiting)
        running_ids = [r.request_id for r in self.running]
        waiting_ids = [r.request_id for r in waiting]
        assert len(set(running_ids)) == len(running_ids) and len(set(waiting_ids)) == len(waiting_ids)
        assert set(running_ids) | set(waiting_ids) == set(self.requests), "requests lost or duplicated"
        assert not set(running_ids) & set(waiting_ids)
        assert len(self.running) <= self.config.max_num_seqs
        assert set(self.kv.req_to_blocks) <= set(running_ids), "a waiting request holds blocks"
        for request in waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), request
            assert request.num_computed_tokens == 0, request
        for request in self.running:
            assert request.status == RequestStatus.RUNNING, request
            assert 0 <= request.num_computed_tokens <= request.num_tokens <= self.max_model_len, request
            pending = self._in_flight.get(request.request_id, 0)
            num_blocks = len(self.kv.req_to_blocks.get(request.request_id, []))
            # at most one partly filled block per sequence; with speculation, blocks allocated for
            # rejected proposals stay for the next step's
            needed = cdiv(request.num_computed_tokens + pending, self.block_size)
            most = cdiv(request.num_computed_tokens + max(pending, 1 + self.num_spec_tokens) + self.num_lookahead_tokens,
                        self.block_size) if self.num_spec_tokens else needed
            assert needed <= num_blocks <= most, f"{request} holds {num_blocks} blocks"
            # freed out-of-window blocks: all the dead ones, except right after admission with a
            # prefix hit or fork (freed after its first step)
            num_null = self.kv.num_null_blocks(request.request_id)
            assert num_null <= self.kv.num_dead_blocks(request.num_computed_tokens), f"{request}: a live block freed"
