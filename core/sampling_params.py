"""Sampling parameters, vLLM-compatible names and defaults."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from portside.structured.params import GuidedDecodingParams, StructuredOutputsParams

__all__ = ["SamplingParams", "BeamSearchParams", "RequestOutputKind", "StructuredOutputsParams", "GuidedDecodingParams"]

MAX_BEST_OF = 20  # samples a best_of > n request may draw (OpenAI's documented limit for best_of)
MAX_BEAM_WIDTH = 32  # beams per prompt (each step ranks 2 x width candidates per beam)


@dataclass
class BeamSearchParams:
    """`LLM.beam_search` parameters, as vLLM's. Beams are ranked as transformers' `generate(
    num_beams=beam_width, do_sample=False, length_penalty=...)` ranks them: cumulative logprob
    over (generated length) ** length_penalty."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # accepted for vLLM parity; only 0 (deterministic beams) is supported
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # accepted for vLLM parity (beams stop at EOS only)

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be an integer from 1 to {MAX_BEAM_WIDTH}, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1 for beam search, got {self.max_tokens!r}")
        if self.temperature != 0.0:
            raise ValueError("beam search ranks beams by the model's own logprobs: temperature must be 0")


class RequestOutputKind(enum.Enum):
    """What each `RequestOutput` of a running request holds (vLLM's names)."""

    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only what is new since the previous output (a stream's consumer concatenates)
    FINAL_ONLY = 2  # nothing until the request finishes, then everything


@dataclass
class SamplingParams:
    n: int = 1
    best_of: int | None = None  # samples drawn, of which the n with the highest cumulative logprob return; None: n
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    logprobs: int | None = None  # number of top alternatives to return besides the sampled token
    prompt_logprobs: int | None = None  # per prompt token after the first: its logprob and the top-k alternatives
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only, the output text stays "" (no stop strings then)
    # constrained decoding: JSON schema, regex, choice or grammar (`portside.structured`)
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None  # vLLM's older name for the same
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    stop_strings: list[str] = field(init=False, repr=False)  # normalised `stop`

    def __post_init__(self) -> None:
        self.stop_strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError("structured_outputs: set it or guided_decoding (its older name), not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the parameter when a value is out of range."""
        checks = [
            (self.n >= 1, "n", "must be at least 1"),
            (self.temperature >= 0.0, "temperature", "must be non-negative"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (self.top_k == -1 or self.top_k >= 1, "top_k", "must be -1 (disabled) or at least 1"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
            (0.0 < self.repetition_penalty <= 2.0, "repetition_penalty", "must be in (0, 2]"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be at least 1"),
            (self.min_tokens >= 0, "min_tokens", "must be non-negative"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                "min_tokens",
                "must not exceed max_tokens",
            ),
            (self.logprobs is None or self.logprobs >= 0, "logprobs", "must be non-negative"),  # the engine's max_logprobs caps it
            (all(s for s in self.stop_strings), "stop", "must not contain empty strings"),
            (self.detokenize or not self.stop_strings, "stop", "strings need the output text: not with detokenize=False"),
            (self.prompt_logprobs is None or self.prompt_logprobs >= 0, "prompt_logprobs", "must be non-negative"),
            (self.best_of is None or self.best_of >= self.n, "best_of", f"must be at least n ({self.n})"),
            (
                self.best_of is None or self.best_of == self.n or self.best_of <= MAX_BEST_OF,
                "best_of",
                f"must be at most {MAX_BEST_OF} when it exceeds n",
            ),
            (
                self.best_of is None or self.best_of == self.n or self.output_kind is not RequestOutputKind.DELTA,
                "best_of",
                "greater than n cannot be streamed (the best samples are known only once all have finished)",
            ),
            (
                self.structured_outputs is None or self.min_tokens == 0,
                "min_tokens",
                "cannot be combined with structured_outputs (the grammar decides where the output ends)",
            ),
            (
                self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
                "structured_outputs",
                "must be a StructuredOutputsParams",
            ),
        ]
        for ok, name, why in checks:
            if not ok:
                raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    def clone_for_sample(self, index: int) -> SamplingParams:
        """Parameters for sample `index` of a request with several samples (n or best_of > 1):
        one sample, a distinct derived seed, and prompt logprobs on sample 0 only (one prompt)."""
        import dataclasses

        seed = None if self.seed is None else self.seed + index
        return dataclasses.replace(self, n=1, best_of=1, seed=seed, prompt_logprobs=self.prompt_logprobs if index == 0 else None)

    @property
    def num_samples(self) -> int:
        """Sequences the engine generates: best_of (n unless set)."""
        return self.best_of if self.best_of is not None else self.n
