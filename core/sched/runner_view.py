"""What the model runner has been sent of each request, so that each `SchedulerOutput` carries only
what changed (`portside.sched.output`): a request's full state once (`NewRequestData`, also after
a preemption), afterwards the blocks appended since (`CachedRequestData`) and, with pipeline
parallelism (`send_token_ids`: the earlier stages' workers never see the sampled tokens), the
tokens appended since it was last scheduled."""

from __future__ import annotations

from portside.kv_cache.manager import KVCacheManager
from portside.request import Request
from portside.sched.output import CachedRequestData, NewRequestData


class RunnerView:
    def __init__(self, kv: KVCacheManager, send_token_ids: bool) -> None:
        self.kv = kv
        self.send_token_ids = send_token_ids  # cached requests carry their new tokens (pipeline parallelism)
        self._num_sent_blocks: dict[str, int] = {}  # req_id -> block ids the runner knows
        self._num_sent_tokens: dict[str, int] = {}  # req_id -> tokens the runner was sent (send_token_ids)

    def new_request(self, request: Request) -> NewRequestData:
        """The whole request, for a runner that does not know it (admitted, or resumed after a preemption)."""
        block_ids = self.kv.get_block_ids(request.request_id)
        assert self.kv.num_null_blocks(request.request_id) == 0, f"{request} is admitted holding a freed block"
        self._num_sent_blocks[request.request_id] = len(block_ids)
        if self.send_token_ids:
            self._num_sent_tokens[request.request_id] = request.num_tokens
        return NewRequestData(
            req_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            output_token_ids=list(request.output_token_ids),
            sampling_params=request.sampling_params,
            block_ids=block_ids,
            num_computed_tokens=request.num_computed_tokens,
            lora_request=request.lora_request,
            mm_features=request.mm_features,
            state_slot=self.kv.state_slot(request.request_id),
            token_type_ids=request.token_type_ids,
        )

    def cached_request(self, request: Request) -> CachedRequestData:
        """What changed since the runner was last sent the request."""
        block_ids = self.kv.get_block_ids(request.request_id)
        num_sent = self._num_sent_blocks[request.request_id]
        self._num_sent_blocks[request.request_id] = len(block_ids)
        assert self.kv.num_null_blocks(request.request_id) <= num_sent, f"{request}: a freed block was never sent"
        new_token_ids: list[int] = []
        if self.send_token_ids:
            sent = self._num_sent_tokens[request.request_id]
            new_token_ids = list(request.output_token_ids[sent - request.num_prompt_tokens :])
            self._num_sent_tokens[request.request_id] = request.num_tokens
        return CachedRequestData(
            req_id=request.request_id,
            new_block_ids=block_ids[num_sent:],
            num_computed_tokens=request.num_computed_tokens,
            new_token_ids=new_token_ids,
        )

    def forget(self, req_id: str) -> None:
        """The runner forgets the request (finished or preempted): it is sent whole if it comes back."""
        self._num_sent_blocks.pop(req_id, None)
        self._num_sent_tokens.pop(req_id, None)
