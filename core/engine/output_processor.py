"""Turns scheduler requests into `RequestOutput`s: detokenizes, applies stop strings, collects
logprobs and prompt logprobs, and groups the samples of an n>1 request (of a best_of > n one,
returning the n with the highest cumulative logprob once all have finished). Each request gets
outputs of its `SamplingParams.output_kind`: cumulative, deltas (what is new since the last one:
a stream's consumer never receives a copy of everything at every step) or the final one only."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from portside.engine.detokenizer import IncrementalDetokenizer, find_stop
from portside.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput, SpecDecodeStats
from portside.request import Request
from portside.sampling_params import RequestOutputKind
from portside.sched.output import LogprobsLists

if TYPE_CHECKING:
    from portside.engine.processor import EngineRequest


@dataclass
class SampleState:
    index: int
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_chars: int = 0  # DELTA: text, tokens and finish already handed out
    sent_tokens: int = 0
    sent_finish: bool = False


@dataclass
class RequestGroup:
    """One user request: n samples that finish independently."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: dict[str, SampleState]  # internal request id -> state
    stops: list[str]
    include_stop: bool
    want_logprobs: bool
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    first_scheduled_time: float | None = None  # of its earliest sample (metrics: queue time)
    last_token_time: float | None = None  # when the latest step gave it tokens (metrics: inter-token latency)
    num_cached_tokens: int = 0
    kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # prompt_logprobs: [None] + one entry per prompt token computed so far (None: not asked)
    prompt_logprobs: PromptLogprobs | None = None
    prompt_logprobs_sent: bool = False  # DELTA: handed out already
    best_n: int | None = None  # best_of > n: how many samples to return (the rest are dropped)
    spec_stats: dict[str, SpecDecodeStats] = field(default_factory=dict)  # speculative decoding, per sample

    @property
    def prompt_logprobs_done(self) -> PromptLogprobs | None:
        """The prompt logprobs once every prompt token has its entry."""
        pl = self.prompt_logprobs
        return pl if pl is not None and len(pl) == len(self.prompt_token_ids) else None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples.values())

    def hold_back(self) -> int:
        """Characters withheld from unfinished text: a stop string may still be forming there."""
        return max((len(s) for s in self.stops), default=1) - 1

    def to_output(self) -> RequestOutput | None:
        """The output to hand out now, of this request's kind (None: nothing to hand out)."""
        if (self.kind is RequestOutputKind.FINAL_ONLY or self.best_n is not None) and not self.finished:
            return None
        delta = self.kind is RequestOutputKind.DELTA
        outs = []
        hb = self.hold_back()
        samples, dropped = self._returned_samples()
        for index, s in samples:
            text = s.detok.text
            if s.finish_reason is None and hb:
                text = text[: max(0, len(text) - hb)]
            start = 0
            if delta:
                if s.sent_finish:
                    continue
                start, text = s.sent_tokens, text[s.sent_chars :]
                if not text and start == len(s.token_ids) and s.finish_reason is None:
                    continue  # nothing new for this sample
                s.sent_chars += len(text)
                s.sent_tokens, s.sent_finish = len(s.token_ids), s.finish_reason is not None
            outs.append(
                CompletionOutput(
                    index=index,
                    text=text,
                    token_ids=s.token_ids[start:],
                    cumulative_logprob=s.cumulative_logprob if self.want_logprobs or self.best_n is not None else None,
                    logprobs=s.logprobs[start:] if s.logprobs is not None else None,
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                )
            )
        metrics = {"arrival_time": self.arrival_time}
        if self.first_token_time is not None:
            metrics["first_token_time"] = self.first_token_time
        if self.first_scheduled_time is not None:
            metrics["first_scheduled_time"] = self.first_scheduled_time
        prompt_logprobs = self.prompt_logprobs_done
        if delta and prompt_logprobs is not None:
            prompt_logprobs, self.prompt_logprobs_sent = (None if self.prompt_logprobs_sent else prompt_logprobs), True
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outs,
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
            metrics=metrics,
            prompt_logprobs=prompt_logprobs,
            num_dropped_tokens=dropped,
            spec_decode_stats=self._spec_decode_stats(),
        )

    def _spec_decode_stats(self) -> SpecDecodeStats | None:
        if not self.spec_stats:
            return None
        total = SpecDecodeStats()
        for stats in self.spec_stats.values():
            total.add(stats)
        return total

    def _returned_samples(self) -> tuple[list[tuple[int, SampleState]], int]:
        """(output index, sample) of the samples to return, and the tokens of those dropped.
        best_of > n: the n with the highest cumulative logprob (ties: the lower sample index),
        numbered 0..n-1 best first (as vLLM's best_of did)."""
        ordered = sorted(self.samples.values(), key=lambda s: s.index)
        if self.best_n is None:
            return [(s.index, s) for s in ordered], 0
        ranked = sorted(ordered, key=lambda s: -s.cumulative_logprob)
        kept, rest = ranked[: self.best_n], ranked[self.best_n :]
        return list(enumerate(kept)), sum(len(s.token_ids) for s in rest)


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.groups: dict[str, RequestGroup] = {}  # user request id -> group
        self.owner: dict[str, str] = {}  # internal request id -> user request id
        # seconds between a request's tokens, one per request that got tokens in the latest step
        # after its first (the engine clears it at the start of each step)
        self.token_intervals: list[float] = []
        # token id -> its text alone (Logprob.decoded_token): at most one entry per vocabulary id,
        # so the top-k alternatives of every position (n=128 x 480 tokens x 21: 1.3M) cost a lookup
        self._token_text: dict[int, str] = {}

    def add_request(self, request: EngineRequest) -> None:
        """Track a request the input processor validated: one sample per sequence it runs."""
        params, prompt_ids = request.params, request.prompt_token_ids
        samples = {
            seq.request_id: SampleState(
                index=k,
                detok=IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens, params.detokenize),
                logprobs=[] if params.logprobs is not None else None,
            )
            for k, seq in enumerate(request.sequences)
        }
        self.groups[request.request_id] = RequestGroup(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=prompt_ids,
            samples=samples,
            stops=params.stop_strings,
            include_stop=params.include_stop_str_in_output,
            want_logprobs=params.logprobs is not None,
            kind=params.output_kind,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            best_n=request.best_n,
        )
        for rid in samples:
            self.owner[rid] = request.request_id

    def _decode_token(self, token_id: int) -> str:
        """A token's text alone, decoded here on the engine thread: the server uses
        `Logprob.decoded_token` and never decodes logprob tokens on its event loop."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def process(self, requests: list[Request], logprobs: dict[str, LogprobsLists]) -> tuple[list[RequestOutput], list[str]]:
        """Update groups from the requests the scheduler advanced. Returns the outputs to emit and
        the internal ids that hit a stop string (the caller finishes them in the scheduler)."""
        touched: dict[str, RequestGroup] = {}
        stopped: list[str] = []
        now = time.monotonic()
        for req in requests:
            gid = self.owner.get(req.request_id)
            if gid is None:
                continue
            group = self.groups[gid]
            sample = group.samples[req.request_id]
            if sample.finish_reason is not None:
                continue
            touched[gid] = group
            new_tokens = req.output_token_ids[len(sample.token_ids) :]
            if new_tokens and group.first_token_time is None:
                group.first_token_time = now
            sched = req.first_scheduled_time
            if sched is not None and (group.first_scheduled_time is None or sched < group.first_scheduled_time):
                group.first_scheduled_time = sched
            if new_tokens and group.last_token_time != now:  # once per request and step, whatever its n
                if group.last_token_time is not None:
                    self.token_intervals.append(now - group.last_token_time)
                group.last_token_time = now
            if req.num_cached_tokens > group.num_cached_tokens:
                group.num_cached_tokens = req.num_cached_tokens
            if req.spec_stats is not None:
                group.spec_stats[req.request_id] = req.spec_stats
            num_before = len(sample.token_ids)
            for tok in new_tokens:
                sample.token_ids.append(tok)
                delta = sample.detok.add(tok)
                hit = find_stop(sample.detok.text, len(delta), group.stops, group.include_stop)
                if hit is not None:
                    sample.detok.text, sample.stop_reason = hit
                    sample.finish_reason = "stop"
                    stopped.append(req.request_id)
                    break
            # a step may bring several tokens (speculative decoding): none past a stop
            self._add_logprobs(sample, logprobs.get(req.request_id), len(sample.token_ids) - num_before)
            if sample.finish_reason is None and req.is_finished:
                sample.finish_reason = req.status.finish_reason
                sample.stop_reason = req.stop_reason
        outputs = []
        for gid, group in touched.items():
            out = group.to_output()
            if out is not None:
                outputs.append(out)
            if group.finished:
                self.remove(gid)
        return outputs, stopped

    def _entries(self, lp: LogprobsLists) -> list[dict[int, Logprob]]:
        """Per token: token id -> Logprob, the token itself first, then its top-k alternatives."""
        out = []
        for ids, vals, rank in zip(lp.token_ids, lp.logprobs, lp.sampled_ranks):
            entry = {ids[0]: Logprob(vals[0], rank, self._decode_token(ids[0]))}
            for r, (tid, val) in enumerate(zip(ids[1:], vals[1:]), start=1):
                entry.setdefault(tid, Logprob(val, r, self._decode_token(tid)))
            out.append(entry)
        return out

    def _add_logprobs(self, sample: SampleState, lp: LogprobsLists | None, num_tokens: int) -> None:
        """Cumulative logprob always (best_of ranks by it); the entries when the caller asked;
        for the first `num_tokens` tokens of `lp` (those kept)."""
        if lp is None:
            return
        if num_tokens < len(lp.token_ids):
            lp = LogprobsLists(lp.token_ids[:num_tokens], lp.logprobs[:num_tokens], lp.sampled_ranks[:num_tokens])
        sample.cumulative_logprob += sum(vals[0] for vals in lp.logprobs)
        if sample.logprobs is not None:
            sample.logprobs.extend(self._entries(lp))

    def add_prompt_logprobs(self, chunks: dict[str, tuple[int, LogprobsLists]]) -> None:
        """File a step's prompt-logprob chunks (`ModelRunnerOutput.prompt_logprobs`) by position;
        positions a recompute after preemption sends again are already there and skipped."""
        for rid, (start, lp) in chunks.items():
            gid = self.owner.get(rid)
            group = self.groups.get(gid) if gid is not None else None
            if group is None or group.prompt_logprobs is None:
                continue
            have = len(group.prompt_logprobs)  # entries for prompt tokens 0 .. have-1
            skip = have - (start + 1)
            assert skip >= 0, f"{rid}: prompt logprobs from position {start}, but only {have} entries so far"
            if skip >= len(lp.token_ids):
                continue
            rest = LogprobsLists(lp.token_ids[skip:], lp.logprobs[skip:], lp.sampled_ranks[skip:])
            group.prompt_logprobs.extend(self._entries(rest))

    def abort(self, request_id: str) -> RequestOutput | None:
        group = self.groups.get(request_id)
        if group is None:
            return None
        for s in group.samples.values():
            if s.finish_reason is None:
                s.finish_reason = "abort"
        out = group.to_output()
        self.remove(request_id)
        return out

    def remove(self, request_id: str) -> None:
        group = self.groups.pop(request_id, None)
        if group is not None:
            for rid in group.samples:
                self.owner.pop(rid, None)
