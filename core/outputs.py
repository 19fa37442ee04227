"""What the engine hands back to callers (vLLM-compatible shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token plus the top-k).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token: None for the first (nothing predicts it), then token id -> Logprob
# (the prompt token itself plus the top-k), as vLLM's `RequestOutput.prompt_logprobs`.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class SpecDecodeStats:
    """Speculative decoding of one request (all its samples): steps that verified proposals,
    tokens proposed, tokens accepted, and how often the proposal at each position was accepted
    (entry i: position i + 1 of a proposal)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_draft_tokens_cut_by_grammar: int = 0  # proposals a grammar refused before verification

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        if len(self.num_accepted_tokens_per_pos) < num_proposed:
            self.num_accepted_tokens_per_pos.extend([0] * (num_proposed - len(self.num_accepted_tokens_per_pos)))
        for i in range(num_accepted):
            self.num_accepted_tokens_per_pos[i] += 1

    def add(self, other: SpecDecodeStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_draft_tokens_cut_by_grammar += other.num_draft_tokens_cut_by_grammar
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (len(other.num_accepted_tokens_per_pos) - len(per_pos)))
        for i, n in enumerate(other.num_accepted_tokens_per_pos):
            per_pos[i] += n

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_length(self) -> float:
        """Tokens a verification step yields on average: 1 + accepted proposals per draft (vLLM's
        "mean acceptance length"); 0 without drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: dict[str, float] = field(default_factory=dict)  # arrival, first_token, finished times
    pooled: list[float] | None = None  # task embed: the prompt's pooled vector (its embedding)
    # prompt_logprobs: set once the whole prompt is computed (in DELTA outputs: on the first such output)
    prompt_logprobs: PromptLogprobs | None = None
    num_dropped_tokens: int = 0  # best_of > n: tokens of the samples not returned (they count in usage)
    spec_decode_stats: SpecDecodeStats | None = None  # speculative decoding: proposals and acceptances so far

    def add(self, delta: RequestOutput) -> None:
        """Fold a later DELTA output of the same request into this one (a slow consumer then
        reads one output holding everything it missed)."""
        mine = {c.index: c for c in self.outputs}
        for c in delta.outputs:
            cur = mine.get(c.index)
            if cur is None:
                self.outputs.append(c)
                mine[c.index] = c
                continue
            cur.text += c.text
            cur.token_ids.extend(c.token_ids)  # the lists of a delta are its own: extend in place
            if cur.logprobs is not None and c.logprobs is not None:
                cur.logprobs.extend(c.logprobs)
            cur.cumulative_logprob = c.cumulative_logprob
            cur.finish_reason, cur.stop_reason = c.finish_reason, c.stop_reason
        self.outputs.sort(key=lambda c: c.index)
        self.finished = delta.finished
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        self.metrics = delta.metrics
        if delta.pooled is not None:
            self.pooled = delta.pooled
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.num_dropped_tokens = max(self.num_dropped_tokens, delta.num_dropped_tokens)
        if delta.spec_decode_stats is not None:
            self.spec_decode_stats = delta.spec_decode_stats  # cumulative: the latest is the whole


@dataclass
class BeamSearchSequence:
    """One finished beam: `tokens` are the prompt's and the generated ones (an EOS that ended it
    included), `text` the generated part decoded, `cum_logprob` the sum of its tokens' logprobs."""

    tokens: list[int]
    cum_logprob: float
    text: str = ""
    score: float = 0.0  # what beams are ranked by: cum_logprob / generated_len ** length_penalty
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)


@dataclass
class BeamSearchOutput:
    """What `LLM.beam_search` returns per prompt: up to beam_width sequences, best first."""

    sequences: list[BeamSearchSequence]


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What `LLM.embed` returns per prompt (vLLM's shape: `.outputs.embedding`)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
