"""The two dataclasses that cross the scheduler <-> model-runner boundary.

`SchedulerOutput` is a diff: a request's full state is sent once (`NewRequestData`, also after a
preemption), afterwards only what changed (`CachedRequestData`). The runner keeps the rest, and
appends the tokens it sampled itself. This keeps per-step messages small for multi-process
tensor parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from portside.sampling_params import SamplingParams

if TYPE_CHECKING:  # torch-free here: the scheduler imports this module
    from portside.structured.manager import GrammarBitmask


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty when resumed after preemption (recompute)
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # prefix-cache hit (or fork) length: the runner computes from here
    lora_request: Any = None  # a portside.lora.request.LoRARequest: the adapter its tokens use
    mm_features: list[Any] = field(default_factory=list)  # its images (portside.multimodal.inputs.MultiModalFeature)
    state_slot: int = -1  # its recurrent layers' state slot (a hybrid model's; -1: none)
    token_type_ids: list[int] | None = None  # encoder-only models: the prompt's segment ids (None: all 0)


@dataclass
class CachedRequestData:
    req_id: str
    new_block_ids: list[int]  # blocks appended since the request was last scheduled
    num_computed_tokens: int
    # pipeline parallelism: the tokens appended since it was last scheduled (the earlier stages'
    # runners never see the sampled ones); empty otherwise
    new_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    # req_id -> tokens to compute this step (the runner orders the batch itself)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # requests the runner must forget (finished, aborted, or preempted since the last step)
    finished_req_ids: set[str] = field(default_factory=set)
    # structured output: the grammar masks of the requests that sample under one this step
    grammar: GrammarBitmask | None = None
    # speculative decoding: req_id -> proposals scheduled after its last token (counted in
    # num_scheduled_tokens); the runner samples each of those positions
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # recurrent layers' state slots copied (src, dst) before the step (a prefix hit's saved state
    # into the request's slot) and after it (a slot's state saved at a block boundary)
    state_copies_before: list[tuple[int, int]] = field(default_factory=list)
    state_copies_after: list[tuple[int, int]] = field(default_factory=list)
    # the KV connector's instructions for this step (`portside.kv_transfer.base`); None: none
    kv_connector_metadata: Any = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class LogprobsLists:
    """Per sampled token: the top-k token ids and logprobs (sampled token first), and its rank."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    sampled_ranks: list[int]


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    # req_id -> tokens sampled this step (empty for a prefill chunk that did not reach the end)
    sampled_token_ids: dict[str, list[int]]
    # req_id -> logprobs of the sampled token(s), for requests that asked for logprobs
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # task embed: req_id -> the pooled vector of a request whose prompt was completed this step
    pooled: dict[str, list[float]] = field(default_factory=dict)
    # prompt_logprobs: req_id -> (first position p, lists): entry j holds the logprob of prompt
    # token p + 1 + j (predicted at position p + j) first, then the top-k, for this step's chunk
    prompt_logprobs: dict[str, tuple[int, LogprobsLists]] = field(default_factory=dict)
    # speculative decoding: req_id -> proposed tokens to verify after the ones sampled this step
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # the KV connector's report (a `portside.kv_transfer.base.KVConnectorOutput`): loads finished or failed
    kv_connector_output: Any = None
