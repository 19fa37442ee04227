"""A request as the scheduler sees it: one sequence of tokens being generated.

An n>1 request becomes n `Request`s (one per sample) that share the prompt's KV blocks.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from portside.kv_cache.hashing import stable_key
from portside.outputs import SpecDecodeStats
from portside.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # everything from here on is finished
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    max_tokens: int = 16  # resolved: never past the model's context length
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None  # time.monotonic() when the scheduler first admitted it (metrics)
    priority: int = 0  # lower value = served first under the "priority" policy
    parent_id: str | None = None  # for sample k>0 of an n>1 request: the sample it forks from
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = -1  # prompt tokens found in the prefix cache (-1: not looked up yet)
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    structured: Any = None  # portside.structured.manager.StructuredState of a constrained sequence
    lora_request: Any = None  # portside.lora.request.LoRARequest: the adapter it runs with
    # speculative decoding: the proposed next tokens to verify in its next step (after its last token)
    spec_token_ids: list[int] = field(default_factory=list)
    spec_stats: SpecDecodeStats | None = None  # proposals verified and accepted so far
    # images (portside.multimodal.inputs.MultiModalFeature), by prompt position
    mm_features: list[Any] = field(default_factory=list)
    mm_encoded: set[int] = field(default_factory=set)  # images charged to an encoder budget (scheduler)
    token_type_ids: list[int] | None = None  # encoder-only models: the prompt's segment ids (BERT pairs)

    @property
    def lora_id(self) -> int | None:
        return self.lora_request.lora_int_id if self.lora_request is not None else None

    @property
    def block_hash_root(self) -> int | None:
        """What its first KV block's hash chains on: requests under different adapters compute
        different KV for the same tokens, so they never share prefix-cache blocks. Keyed by the
        adapter's name and folder (stable across restarts, so the disk KV tier finds its blocks)."""
        lora = self.lora_request
        return None if lora is None else stable_key("lora", lora.lora_name, lora.lora_path)

    def block_extra_keys(self, start: int, end: int) -> tuple[str, ...]:
        """What the KV of prompt positions [start, end) depends on beside the tokens: the
        identifiers of the images whose placeholders overlap them (prefix-cache block hashes)."""
        return tuple(f.identifier for f in self.mm_features if f.placeholder.offset < end and start < f.placeholder.end)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def __repr__(self) -> str:  # keeps prompts out of logs
        return (
            f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens} tok, "
            f"output={self.num_output_tokens} tok, computed={self.num_computed_tokens})"
        )
