"""LLMEngine: add_request / abort_request / step, the synchronous heart of portside.

One step: schedule -> execute on every rank -> update the scheduler -> detokenize and emit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from portside.chat_template import render_chat
from portside.engine.args import EngineArgs
from portside.engine.detokenizer import IncrementalDetokenizer
from portside.engine.output_processor import OutputProcessor, RequestGroup, SampleState
from portside.executor import Executor, make_executor
from portside.generation_config import generation_defaults
from portside.lora.registry import LoRARegistry
from portside.outputs import RequestOutput, SpecDecodeStats
from portside.platform import resolve_platform
from portside.request import Request, RequestStatus
from portside.sampling_params import SamplingParams
from portside.sched.output import ModelRunnerOutput, SchedulerOutput
from portside.sched.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks in use
    num_used_blocks: int
    num_total_blocks: int
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # of which found in the cache
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    weight_bytes: int = 0  # the loaded model's weights, every rank together
    # speculative decoding since start (all zero without it)
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    # the latest step: tokens it computed, and the seconds since each request's previous tokens
    step_tokens: int = 0
    token_intervals: list[float] = field(default_factory=list)


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        from transformers import AutoTokenizer

        self.platform = resolve_platform(args.device)
        self.config = config = args.create_engine_config(self.platform)
        # --generation-config: defaults for the sampling fields a caller leaves unset (before the model loads: fail fast)
        self.default_sampling = generation_defaults(args.generation_config, config.model.path)
        self.platform.seed(config.model.seed)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model.tokenizer or config.model.path)
        self.eos_token_id, self.extra_eos_ids = _eos_ids(config.model.path, self.tokenizer)
        # every id that ends a sequence (the tokenizer's and generation_config.json's)
        self.eos_token_ids = [t for t in [self.eos_token_id, *self.extra_eos_ids] if t is not None]
        self.reasoning_parser = _reasoning_parser(args.reasoning_parser, self.tokenizer)  # before the model loads: fail fast
        self.max_model_len = config.model.max_model_len
        self.task = config.model.task  # "generate" or "embed"
        self.executor: Executor = make_executor(config, self.platform, self.eos_token_id)
        block_size = config.cache.block_size
        assert block_size is not None
        try:
            # a model whose every layer has the same window frees the blocks that fall out of it
            from portside.model.registry import read_model_args

            model_args = read_model_args(config.model.path, self.max_model_len)
            self.sliding_window = model_args.uniform_sliding_window
            self.mm_processor = None
            if model_args.hf_config is not None:  # a vision-language model
                from portside.multimodal.processor import MultiModalProcessor

                self.mm_processor = MultiModalProcessor(config.model.path, model_args.hf_config, self.tokenizer,
                                                        config.multimodal)
            num_blocks = self.executor.determine_num_blocks()
            needed = _blocks_per_request(
                block_size, self.max_model_len, config.scheduler.max_num_batched_tokens, self.sliding_window
            )
            if num_blocks < needed:
                raise ValueError(
                    f"the KV cache holds {num_blocks} blocks x {block_size} tokens = {num_blocks * block_size} tokens, "
                    f"fewer than one request may need at once ({needed} blocks for max_model_len {self.max_model_len}"
                    + (f", sliding window {self.sliding_window}" if self.sliding_window else "")
                    + "): one long request could never finish. Raise kv_cache_memory / num_kv_blocks or lower max_model_len"
                )
            self.executor.initialize_kv_cache(num_blocks)
        except BaseException:
            self.executor.shutdown()  # no worker process outlives a failed start
            raise
        self.num_blocks = num_blocks
        # pipeline parallelism: scheduled steps kept in flight (oldest first), as many as the executor takes
        self.max_in_flight = self.executor.max_concurrent_batches
        self._batches: deque[tuple[SchedulerOutput, Callable[[], ModelRunnerOutput]]] = deque()
        self.scheduler = Scheduler(
            config.scheduler,
            block_size=block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            max_model_len=self.max_model_len,
            sliding_window=self.sliding_window,
            max_loras=config.lora.max_loras if config.lora is not None else 0,
            num_spec_tokens=config.speculative.num_speculative_tokens if config.speculative is not None else 0,
            num_lookahead_tokens=config.speculative.num_lookahead_tokens if config.speculative is not None else 0,
            num_micro_batches=self.max_in_flight,
            micro_batch_tokens=config.parallel.pipeline_micro_batch_tokens or self.platform.pipeline_micro_batch_tokens,
            send_token_ids=config.parallel.pipeline_parallel_size > 1,
            max_encoder_tokens=config.multimodal.max_encoder_tokens_per_step,
        )
        self.loras = LoRARegistry(config.lora, config.model.path)
        self.outputs = OutputProcessor(self.tokenizer)
        self.vocab_size = self.executor.vocab_size
        from portside.structured.manager import StructuredOutputManager

        self.structured = StructuredOutputManager(args.structured_outputs_backend, self.tokenizer, self.vocab_size,
                                                  self.eos_token_ids, self.reasoning_parser)
        self.weight_bytes: int = self.executor.weight_bytes
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.step_tokens = 0  # tokens the latest step computed (metrics)
        quant = config.model.quantization
        if config.speculative is not None:
            logger.info("speculative decoding: %s", config.speculative.describe())
        logger.info("portside engine ready: %s on %s, dtype %s%s, weights %.1f MiB, %d KV blocks of %d",
                    config.model.path, self.platform.name, config.model.dtype, f", {quant.describe()}" if quant else "",
                    self.weight_bytes / 2**20, num_blocks, block_size)

    @classmethod
    def from_args(cls, **kwargs: Any) -> LLMEngine:
        return cls(EngineArgs(**kwargs))

    # ---- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict[str, Any],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        add_special_tokens: bool = True,
        lora_request: Any = None,
    ) -> None:
        """Queue a request: text, token ids, or a {"prompt": ...} / {"prompt_token_ids": [...]}
        dict (with both, as `apply_chat_template` returns, the ids are the prompt and the text is
        what outputs show). Raises ValueError naming the problem for bad input. A chat prompt
        rendered as text already has its special tokens: pass add_special_tokens=False.
        `lora_request`: a `LoRARequest`, the adapter this request runs with (enable_lora).
        Under task embed a request ends once its prompt is computed, its output carrying the
        pooled vector (`RequestOutput.pooled`); of `params` only `output_kind` then applies."""
        params = params or SamplingParams()
        limit = self.config.model.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and limit >= 0 and k > limit:
                raise ValueError(f"{name}: {k} requested, more than the {limit} allowed (max_logprobs, "
                                 "the server's --max-logprobs); ask for fewer")
        self.loras.check(lora_request)
        if request_id in self.outputs.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_text, prompt_ids, mm_features = self._prompt(prompt, add_special_tokens)
        self._validate(prompt_ids, params)
        if mm_features and self.task == "embed":
            raise ValueError("task embed: prompts with images are not supported")
        if self.task == "embed" and (params.num_samples != 1 or params.structured_outputs is not None
                                     or params.prompt_logprobs is not None):
            raise ValueError("task embed: a request returns one embedding; n and structured outputs do not apply, "
                             "nor best_of or prompt_logprobs")
        grammar = self.structured.compile(params.structured_outputs) if params.structured_outputs is not None else None
        max_tokens = self.max_model_len - len(prompt_ids)
        if self.task == "embed":
            max_tokens = 0  # prefill only: the scheduler finishes it after its prompt
        elif params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        stop_ids = list(params.stop_token_ids or []) + [t for t in self.extra_eos_ids if t not in (params.stop_token_ids or [])]
        samples: dict[str, SampleState] = {}
        requests = []
        num_samples = params.num_samples
        best_n = params.n if num_samples > params.n else None
        for k in range(num_samples):
            rid = request_id if num_samples == 1 else f"{request_id}#{k}"
            sp = params if num_samples == 1 else params.clone_for_sample(k)
            if best_n is not None and sp.logprobs is None:  # best_of ranks samples by their cumulative logprob
                sp = dataclasses.replace(sp, logprobs=0)
            if stop_ids != sp.stop_token_ids and not sp.ignore_eos:
                sp = _with_stop_ids(sp, stop_ids)
            requests.append(
                Request(
                    request_id=rid,
                    prompt_token_ids=prompt_ids,
                    sampling_params=sp,
                    eos_token_id=self.eos_token_id,
                    max_tokens=max_tokens,
                    priority=priority,
                    parent_id=None if k == 0 else f"{request_id}#0",
                    lora_request=lora_request,
                    mm_features=mm_features,
                    structured=None if grammar is None else self.structured.new_state(
                        grammar, prompt_ids, params.structured_outputs.after_reasoning),  # type: ignore[union-attr]
                )
            )
            samples[rid] = SampleState(
                index=k,
                detok=IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens, params.detokenize),
                logprobs=[] if params.logprobs is not None else None,
            )
        self.outputs.add(
            RequestGroup(
                request_id=request_id,
                prompt=prompt_text,
                prompt_token_ids=prompt_ids,
                samples=samples,
                stops=params.stop_strings,
                include_stop=params.include_stop_str_in_output,
                want_logprobs=params.logprobs is not None,
                kind=params.output_kind,
                prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
                best_n=best_n,
            )
        )
        for req in requests:
            self.scheduler.add_request(req)
        self.prompt_tokens_total += len(prompt_ids)

    def prompt_token_ids(self, prompt: str | list[int] | dict[str, Any], add_special_tokens: bool = True) -> list[int]:
        """A prompt as `add_request` takes it, as token ids."""
        return self._prompt(prompt, add_special_tokens)[1]

    @property
    def supports_images(self) -> bool:
        return self.mm_processor is not None

    def process_multimodal(self, prompt: dict[str, Any], add_special_tokens: bool = True) -> dict[str, Any]:
        """A prompt dict with "multi_modal_data" run through the model's processor: the prompt
        dict `add_request` takes as it is ("prompt_token_ids" with the images' placeholders
        expanded, "prompt", "mm_features"). Safe to call from any thread (the server decodes
        and processes images off the engine thread); ValueError for what cannot be served."""
        text, ids, features = self._prompt(prompt, add_special_tokens)
        return {"prompt_token_ids": ids, "prompt": text, "mm_features": features}

    def _prompt(self, prompt: str | list[int] | dict[str, Any], add_special_tokens: bool
                ) -> tuple[str | None, list[int], list[Any]]:
        """(text shown in outputs, token ids, image features) of a prompt: text, ids, or a prompt
        dict (with both, the ids are the prompt and the text is what outputs show), which may
        carry images ("multi_modal_data": {"image": ...}, or "mm_features" already processed)."""
        shown: str | None = None
        value: Any = prompt
        if isinstance(prompt, dict):
            value = prompt.get("prompt_token_ids", prompt.get("prompt"))
            if value is None:
                raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
            if not isinstance(value, str) and isinstance(prompt.get("prompt"), str):
                shown = prompt["prompt"]
            if prompt.get("multi_modal_data") or prompt.get("mm_features"):
                return self._multimodal_prompt(prompt, value, shown, add_special_tokens)
        if isinstance(value, str):
            return value, self.tokenizer.encode(value, add_special_tokens=add_special_tokens), []
        return shown, list(value), []

    def _multimodal_prompt(self, prompt: dict[str, Any], value: str | list[int], shown: str | None,
                           add_special_tokens: bool) -> tuple[str | None, list[int], list[Any]]:
        from portside.multimodal.processor import check_features, image_list

        if self.mm_processor is None:
            raise ValueError(f"model {self.config.model.path} does not take images (it is not a vision-language model)")
        if prompt.get("mm_features"):  # processed already (`process_multimodal`)
            ids = list(value) if not isinstance(value, str) else self.tokenizer.encode(value, add_special_tokens=add_special_tokens)
            check_features(prompt["mm_features"], ids, self.mm_processor.image_token_id)
            return (value if isinstance(value, str) else shown), ids, list(prompt["mm_features"])
        data = prompt["multi_modal_data"]
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise ValueError("multi_modal_data must be a dict with an 'image' entry (a PIL image or a list of them); "
                             f"got {sorted(data) if isinstance(data, dict) else type(data).__name__}")
        out = self.mm_processor.process(value, image_list(data["image"]), add_special_tokens)
        return (out.prompt if out.prompt is not None else shown), out.prompt_token_ids, out.mm_features

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        params.validate()
        if not prompt_ids:
            raise ValueError("prompt must not be empty")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of range for vocabulary size {self.vocab_size}")
        if self.task == "embed" and len(prompt_ids) > self.max_model_len:
            raise ValueError(f"prompt is {len(prompt_ids)} tokens, more than max_model_len {self.max_model_len}; shorten it "
                             "(or truncate it: truncate_prompt_tokens)")
        if self.task != "embed" and len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(prompt_ids)} tokens, but max_model_len is {self.max_model_len}: "
                "it leaves no room for output; shorten the prompt or raise max_model_len"
            )
        for tid in (params.logit_bias or {}):
            if not 0 <= int(tid) < self.vocab_size:
                raise ValueError(f"logit_bias token id {tid} is out of range for vocabulary size {self.vocab_size}")
        for tid in params.stop_token_ids or []:
            if not 0 <= tid < self.vocab_size:
                raise ValueError(f"stop_token_ids entry {tid} is out of range for vocabulary size {self.vocab_size}")

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Stop requests now; their KV blocks are freed at once (the runner forgets them next step)."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for gid in ids:
            group = self.outputs.groups.get(gid)
            if group is None:
                continue
            self.scheduler.finish_requests(list(group.samples), RequestStatus.FINISHED_ABORTED)
            self.outputs.abort(gid)

    # ---- stepping ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and submit a step, then finish the oldest step in flight and return its
        outputs. With pipeline parallelism up to `max_in_flight` steps are in flight: a step is
        submitted while there is room and something can be scheduled (requests in flight cannot),
        and a call that only submitted returns no outputs."""
        if len(self._batches) < self.max_in_flight:
            so = self.scheduler.schedule()
            if not so.is_empty or so.finished_req_ids:
                so.grammar = self._grammar_bitmask(so)
                with self._failing_steps():
                    self._batches.append((so, self.executor.submit(so)))
                if len(self._batches) < self.max_in_flight and not so.is_empty:
                    return []  # fill the pipeline before waiting on it
        if not self._batches:
            self.step_tokens, self.outputs.token_intervals = 0, []
            return []
        so, result = self._batches.popleft()
        self.step_tokens, self.outputs.token_intervals = so.total_num_scheduled_tokens, []
        with self._failing_steps():
            runner_output = result()
        return self._finish_step(so, runner_output)

    @contextlib.contextmanager
    def _failing_steps(self) -> Iterator[None]:
        """A step the executor failed is no longer in flight: its requests may be scheduled again,
        so the next step reaches the executor and fails the same way (never an idle loop)."""
        try:
            yield
        except BaseException:
            self._batches.clear()
            self.scheduler.forget_in_flight()
            raise

    def _finish_step(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[RequestOutput]:
        if scheduler_output.grammar is not None:
            scheduler_output.grammar.get()  # filled before any matcher advances
        updated = self.scheduler.update_from_output(scheduler_output, runner_output)
        self.generation_tokens_total += sum(len(t) for t in runner_output.sampled_token_ids.values())
        if runner_output.prompt_logprobs:
            self.outputs.add_prompt_logprobs(runner_output.prompt_logprobs)
        outputs, stopped = self.outputs.process(updated, runner_output.logprobs)
        for out in outputs if runner_output.pooled else ():
            out.pooled = runner_output.pooled.get(out.request_id, out.pooled)  # task embed: n is 1, ids match
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs

    def _grammar_bitmask(self, so: Any) -> Any:
        """Start filling the masks of the constrained requests that sample this step (it runs
        while the model computes; the sampler waits for it)."""
        rows = []
        for rid, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            if req.structured is not None and req.num_computed_tokens + n >= req.num_tokens:
                rows.append((rid, req.structured))
        return self.structured.grammar_bitmask(rows) if rows else None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._batches)

    def check_health(self) -> None:
        """RuntimeError when a rank of the executor has died: a step would fail, so an idle engine
        reports it now (the async engine calls this while idle). The executor has then stopped its
        remaining ranks."""
        self.executor.check_health()

    def stats(self) -> EngineStats:
        s = self.scheduler
        usage = s.kv_cache_usage
        return EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_cache_usage=usage,
            num_used_blocks=round(usage * self.num_blocks),
            num_total_blocks=self.num_blocks,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            step_tokens=self.step_tokens,
            token_intervals=self.outputs.token_intervals,
            weight_bytes=self.weight_bytes,
            spec_decode=s.spec_stats,
        )

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, chat_template: str | None = None
    ) -> dict[str, Any]:
        """The conversation as a prompt: {"prompt": rendered text, "prompt_token_ids": ids}, with
        special tokens in user and tool contents tokenized as plain text (`portside.chat_template`)."""
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; pass one (--chat-template)")
        text, ids = render_chat(self.tokenizer, messages, chat_template=chat_template,
                                add_generation_prompt=add_generation_prompt)
        return {"prompt": text, "prompt_token_ids": ids}

    def shutdown(self) -> None:
        self.structured.shutdown()
        self.executor.shutdown()


def _blocks_per_request(block_size: int, max_model_len: int, max_batched: int, window: int | None) -> int:
    """Most blocks one request holds at once. Without a window: its whole length. With one:
    a step computing c <= min(budget, max_model_len) tokens holds at most the W - 1 tokens
    before them and the c tokens, over at most cdiv(W - 1 + c, block_size) + 1 blocks."""
    whole = -(-max_model_len // block_size)
    if window is None:
        return whole
    chunk = min(max_batched, max_model_len)
    return min(whole, -(-(window - 1 + chunk) // block_size) + 1)


def _reasoning_parser(name: str | None, tokenizer: Any) -> Any:
    if name is None:
        return None
    from portside.reasoning import get_reasoning_parser

    return get_reasoning_parser(name)(tokenizer)


def _with_stop_ids(params: SamplingParams, stop_ids: list[int]) -> SamplingParams:
    import dataclasses

    return dataclasses.replace(params, stop_token_ids=stop_ids)


def _eos_ids(model_path: str, tokenizer: Any) -> tuple[int | None, list[int]]:
    """The primary eos id and any extra ones the generation config lists."""
    ids: list[int] = []
    gen = os.path.join(model_path, "generation_config.json")
    if os.path.isfile(gen):
        with open(gen) as f:
            eos = json.load(f).get("eos_token_id")
        ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    primary = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else (ids[0] if ids else None)
    return primary, [t for t in ids if t != primary]
