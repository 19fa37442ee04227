"""Beam search over the engine, ranked as transformers' `generate(num_beams=w, do_sample=False)`.

Each step every live beam is one request: its prompt is the beam's tokens, it computes one
position and returns the top 2w logprobs (the raw log-softmax). The engine's prefix cache gives
each beam its full KV blocks back from the previous step (shared between beams through the block
manager's reference counts), so a step recomputes at most the partial last block of each beam.
`BeamSearchState` is one prompt's bookkeeping and `BeamSearchBatch` a round over several (no
engine in either); `LLM.beam_search` and the server's `use_beam_search` only run each round's
requests (`step_params`):

- candidates: every live beam's top 2w continuations, the best 2w over all by cumulative
  logprob (transformers keeps 2w so that w survive even if w of them end);
- a candidate among the best w that ends (EOS, unless ignore_eos; or max_tokens, or the
  context length) joins the finished beams with score cum_logprob / generated_len **
  length_penalty (generated_len counts the EOS); the best w finished are kept;
- the best w candidates that did not end are the next live beams;
- the search stops when every candidate ends, or when w beams have finished and the best live
  beam's cumulative logprob over its current length ** length_penalty no longer beats the worst
  finished score (transformers' default early-stopping heuristic).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from portside.outputs import BeamSearchSequence, Logprob, RequestOutput
from portside.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


def step_params(beam_width: int, max_logprobs: int, logprobs_mode: str = "raw_logprobs") -> SamplingParams:
    """The parameters of every beam's one-token request (greedy, top 2w raw logprobs, only the
    final output). ValueError when the engine's `max_logprobs` cannot return 2w, or its
    `logprobs_mode` returns logits (a greedy row's processed logprobs are its raw ones)."""
    if logprobs_mode.endswith("_logits"):
        raise ValueError(f"beam search ranks beams by logprobs, but this engine returns logits (logprobs_mode "
                         f"{logprobs_mode}); use an engine with logprobs_mode raw_logprobs or processed_logprobs")
    k = 2 * beam_width
    if 0 <= max_logprobs < k:
        raise ValueError(f"beam search with beam_width {beam_width} ranks the top {k} logprobs of each beam, more than "
                         f"max_logprobs (--max-logprobs) {max_logprobs} allows: raise max_logprobs to at least {k}")
    return SamplingParams(temperature=0.0, max_tokens=1, logprobs=k, ignore_eos=True,
                          output_kind=RequestOutputKind.FINAL_ONLY)


@dataclass
class _Beam:
    tokens: list[int]  # generated so far
    cum_logprob: float
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)


class BeamSearchState:
    def __init__(self, prompt_ids: list[int], params: BeamSearchParams, eos_token_ids: list[int],
                 max_model_len: int) -> None:
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.eos_token_ids = set(eos_token_ids)
        self.max_new = min(params.max_tokens, max_model_len - len(prompt_ids))
        self.live: list[_Beam] = [_Beam([], 0.0)] if self.max_new > 0 else []
        self.finished: list[tuple[float, _Beam, str]] = []  # (score, beam, finish reason), best first
        self.improvable = True

    @property
    def num_logprobs(self) -> int:
        return 2 * self.params.beam_width

    @property
    def done(self) -> bool:
        return not self.live

    def beam_prompts(self) -> list[list[int]]:
        """The token ids of each live beam: one request each for this step."""
        return [self.prompt_ids + b.tokens for b in self.live]

    def advance(self, top_logprobs: list[dict[int, Logprob]]) -> None:
        """One step: `top_logprobs[i]` is live beam i's next-token top logprobs (at least 2w)."""
        w, lp = self.params.beam_width, self.params.length_penalty
        cands = []
        for beam, top in zip(self.live, top_logprobs, strict=True):
            best = sorted(top.items(), key=lambda kv: -kv[1].logprob)[: self.num_logprobs]
            cands += [(beam.cum_logprob + v.logprob, beam, t, v) for t, v in best]
        cands.sort(key=lambda c: -c[0])  # stable: ties keep beam order, then token rank
        cands = cands[: self.num_logprobs]
        gen_len = len(self.live[0].tokens) + 1
        at_length = gen_len >= self.max_new
        next_live: list[_Beam] = []
        for i, (score, beam, tok, val) in enumerate(cands):
            new = _Beam(beam.tokens + [tok], score, beam.logprobs + [{tok: val}])
            eos = tok in self.eos_token_ids and not self.params.ignore_eos
            if eos or at_length:
                if i < w and self.improvable:
                    self.finished.append((score / gen_len**lp, new, "stop" if eos else "length"))
            elif len(next_live) < w:
                next_live.append(new)
        self.finished = sorted(self.finished, key=lambda f: -f[0])[:w]
        self.live = [] if at_length else next_live
        if self.live and len(self.finished) == w:
            best_possible = self.live[0].cum_logprob / gen_len**lp
            self.improvable = best_possible > self.finished[-1][0]
        if not self.improvable:
            self.live = []

    def sequences(self, decode) -> list[BeamSearchSequence]:
        """The finished beams, best first (`decode`: token ids -> text)."""
        return [BeamSearchSequence(tokens=self.prompt_ids + b.tokens, cum_logprob=b.cum_logprob, text=decode(b.tokens),
                                   score=score, finish_reason=reason, logprobs=b.logprobs)
                for score, b, reason in self.finished]


class BeamSearchBatch:
    """One round over several prompts' searches: `prompts()` lists every live beam's tokens (one
    request each), `advance(outputs)` takes those requests' outputs in the same order."""

    def __init__(self, states: list[BeamSearchState]) -> None:
        self.states = states
        self._owners: list[BeamSearchState] = []

    @property
    def done(self) -> bool:
        return all(s.done for s in self.states)

    def prompts(self) -> list[list[int]]:
        self._owners = [s for s in self.states for _ in s.live]
        return [b for s in self.states for b in s.beam_prompts()]

    @property
    def owners(self) -> list[BeamSearchState]:
        """The prompt each of the last `prompts()` belongs to."""
        return self._owners

    def advance(self, outputs: list[RequestOutput]) -> None:
        tops: dict[int, list[dict[int, Logprob]]] = {}
        for owner, out in zip(self._owners, outputs, strict=True):
            lps = out.outputs[0].logprobs
            assert lps, "a beam step request returns its top logprobs"
            tops.setdefault(id(owner), []).append(lps[0])
        for s in self.states:
            if not s.done:
                s.advance(tops[id(s)])
