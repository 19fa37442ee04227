"""LLMEngine: add_request / abort_request / step, the synchronous heart of portside.

A request goes through the input processor (`portside.engine.processor`: validated, tokenized,
resolved into one sequence per sample), then to the scheduler and the output processor. One
step: schedule -> execute on every rank -> update the scheduler -> detokenize and emit.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from portside.engine.args import EngineArgs
from portside.engine.kv_events import KVEventStream, resolve_kv_events_config
from portside.engine.output_processor import OutputProcessor
from portside.engine.processor import EosIds, InputProcessor, Prompt
from portside.engine.rl_engine import EngineRL
from portside.engine.stats import EngineStats
from portside.executor import Executor, make_executor
from portside.generation_config import generation_defaults
from portside.kv_cache.state import num_state_slots
from portside.kv_transfer.factory import make_scheduler_connector
from portside.lora.registry import LoRARegistry
from portside.model.args import MULTIMODAL_ARCHS
from portside.model.registry import architecture_needs, read_model_args
from portside.multimodal.processor import MultiModalProcessor
from portside.outputs import RequestOutput
from portside.platform import resolve_platform
from portside.reasoning import get_reasoning_parser
from portside.request import RequestStatus
from portside.sampling_params import SamplingParams
from portside.sched.output import ModelRunnerOutput, SchedulerOutput
from portside.sched.scheduler import Scheduler
from portside.structured.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class _OfProcessor:
    """An attribute of the engine's input processor, read and set through the engine."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, engine: Any, owner: type | None = None) -> Any:
        return self if engine is None else getattr(engine.processor, self.name)

    def __set__(self, engine: Any, value: Any) -> None:
        setattr(engine.processor, self.name, value)


class LLMEngine(EngineRL):
    # the grammar cache and the adapter registry (a data-parallel front shares replica 0's with every replica)
    structured: StructuredOutputManager = _OfProcessor()  # type: ignore[assignment]
    loras: LoRARegistry = _OfProcessor()  # type: ignore[assignment]

    def __init__(self, args: EngineArgs) -> None:
        self.platform = resolve_platform(args.device)
        self.config = config = args.create_engine_config(self.platform)
        self.kv_events = self._open_kv_events(args)  # sockets bound before the model loads (fail fast)
        self._load_tokenizer(args)  # with the generation defaults and reasoning parser: before the model loads (fail fast)
        self.max_model_len = config.model.max_model_len
        self.task = config.model.task  # "generate" or "embed"
        assert config.cache.block_size is not None
        self.block_size: int = config.cache.block_size
        self.executor: Executor = make_executor(config, self.platform, self.eos_token_id)
        try:
            mm_processor = self._allocate_kv_cache()
        except BaseException:
            self.executor.shutdown()  # no worker process outlives a failed start
            if self.kv_events is not None:
                self.kv_events.shutdown()
            raise
        # pipeline parallelism: scheduled steps kept in flight (oldest first), as many as the executor takes
        self.max_in_flight = self.executor.max_concurrent_batches
        self._batches: deque[tuple[SchedulerOutput, Callable[[], ModelRunnerOutput]]] = deque()
        self.scheduler = self._make_scheduler()
        if self.kv_events is not None:
            self.scheduler.kv.pool.events = self.kv_events.recorder
        self.outputs = OutputProcessor(self.tokenizer)
        self.vocab_size = self.executor.vocab_size
        self.processor = InputProcessor(
            config, self.tokenizer, self.vocab_size, self.eos, mm_processor=mm_processor,
            loras=LoRARegistry(config.lora, config.model.path),
            structured=StructuredOutputManager(args.structured_outputs_backend, self.tokenizer, self.vocab_size,
                                               self.eos_token_ids, self.reasoning_parser),
        )
        self.weight_bytes: int = self.executor.weight_bytes
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.step_tokens = 0  # tokens the latest step computed (metrics)
        self._log_ready()

    def _load_tokenizer(self, args: EngineArgs) -> None:
        """The tokenizer, the ids that end a sequence, the reasoning parser, and the sampling
        defaults of --generation-config (for the fields a caller leaves unset)."""
        from transformers import AutoTokenizer

        model = self.config.model
        self.default_sampling = generation_defaults(args.generation_config, model.path)
        self.platform.seed(model.seed)
        self.tokenizer = AutoTokenizer.from_pretrained(model.tokenizer or model.path)
        self.eos = EosIds.read(model.path, self.tokenizer)
        self.eos_token_id = self.eos.primary
        self.eos_token_ids = self.eos.all  # every id that ends a sequence (the tokenizer's and generation_config.json's)
        self.reasoning_parser = None if args.reasoning_parser is None else get_reasoning_parser(args.reasoning_parser)(self.tokenizer)

    def _open_kv_events(self, args: EngineArgs) -> KVEventStream | None:
        """The KV-events publisher of --kv-events-config (None: events off)."""
        config = resolve_kv_events_config(args.kv_events_config, args.kv_events_publisher, args.kv_events_endpoint)
        if config is None:
            return None
        if not self.config.cache.enable_prefix_caching:
            logger.warning("KV events report the prefix cache's blocks; with prefix caching off none are stored")
        assert self.config.cache.block_size is not None
        return KVEventStream(config, self.config.cache.block_size, args.data_parallel_rank)

    def _allocate_kv_cache(self) -> MultiModalProcessor | None:
        """Read the model's shape, size the KV cache to what the executor's ranks hold (refused when
        one long request could never finish) and allocate it. Returns the model's image
        processor (None: a text-only model)."""
        config, block_size = self.config, self.block_size
        model_args = read_model_args(config.model.path, self.max_model_len)
        # a model whose every layer has the same window frees the blocks that fall out of it
        self.sliding_window = model_args.uniform_sliding_window
        # a hybrid model's recurrent layers: one state slot per running request, more for prefix caching
        self.num_state_slots = num_state_slots(config.scheduler.max_num_seqs, config.cache.enable_prefix_caching) \
            if "recurrent" in architecture_needs(model_args.architecture) else 0
        mm_processor = None
        if model_args.architecture in MULTIMODAL_ARCHS:  # a vision-language model
            mm_processor = MultiModalProcessor(config.model.path, model_args.hf_config, self.tokenizer, config.multimodal)
        num_blocks = self.executor.determine_num_blocks()
        needed = _blocks_per_request(block_size, self.max_model_len, config.scheduler.max_num_batched_tokens,
                                     self.sliding_window)
        if num_blocks < needed:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks x {block_size} tokens = {num_blocks * block_size} tokens, "
                f"fewer than one request may need at once ({needed} blocks for max_model_len {self.max_model_len}"
                + (f", sliding window {self.sliding_window}" if self.sliding_window else "")
                + "): one long request could never finish. Raise kv_cache_memory / num_kv_blocks or lower max_model_len"
            )
        self.executor.initialize_kv_cache(num_blocks)
        self.num_blocks = num_blocks
        return mm_processor

    def _make_scheduler(self) -> Scheduler:
        config = self.config
        spec = config.speculative
        return Scheduler(
            config.scheduler,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            max_model_len=self.max_model_len,
            sliding_window=self.sliding_window,
            max_loras=config.lora.max_loras if config.lora is not None else 0,
            num_spec_tokens=spec.num_speculative_tokens if spec is not None else 0,
            num_lookahead_tokens=spec.num_lookahead_tokens if spec is not None else 0,
            num_micro_batches=self.max_in_flight,
            micro_batch_tokens=config.parallel.pipeline_micro_batch_tokens or self.platform.pipeline_micro_batch_tokens,
            send_token_ids=config.parallel.pipeline_parallel_size > 1,
            max_encoder_tokens=config.multimodal.max_encoder_tokens_per_step,
            num_state_slots=self.num_state_slots,
            kv_connector=make_scheduler_connector(config, self.block_size, lambda: self.executor.collective_rpc(
                "kv_transfer_info"), self.num_state_slots),
        )

    def _log_ready(self) -> None:
        config = self.config
        quant = config.model.quantization
        if config.speculative is not None:
            logger.info("speculative decoding: %s", config.speculative.describe())
        logger.info("portside engine ready: %s on %s, dtype %s%s, weights %.1f MiB, %d KV blocks of %d",
                    config.model.path, self.platform.name, config.model.dtype, f", {quant.describe()}" if quant else "",
                    self.weight_bytes / 2**20, self.num_blocks, self.block_size)

    @classmethod
    def from_args(cls, **kwargs: Any) -> LLMEngine:
        return cls(EngineArgs(**kwargs))

    # ---- requests ---------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None, *, priority: int = 0,
                    add_special_tokens: bool = True, lora_request: Any = None) -> None:
        """Queue a request: text, token ids, or a {"prompt": ...} / {"prompt_token_ids": [...]}
        dict (with both, as `apply_chat_template` returns, the ids are the prompt and the text is
        what outputs show), or {"messages": [...]} (rendered through the chat template). Raises
        ValueError naming the problem for bad input (`InputProcessor.process`). A chat prompt
        rendered as text already has its special tokens: pass add_special_tokens=False.
        `lora_request`: a `LoRARequest`, the adapter this request runs with (enable_lora).
        Under task embed a request ends once its prompt is computed, its output carrying the
        pooled vector (`RequestOutput.pooled`); of `params` only `output_kind` then applies."""
        if request_id in self.outputs.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._check_awake()  # EngineAsleepError while asleep (`rl_engine`)
        request = self.processor.process(request_id, prompt, params, priority=priority,
                                         add_special_tokens=add_special_tokens, lora_request=lora_request)
        for seq in request.sequences:
            self.scheduler.add_request(seq)
        self.outputs.add_request(request)
        self.prompt_tokens_total += len(request.prompt_token_ids)

    def prompt_token_ids(self, prompt: Prompt, add_special_tokens: bool = True) -> list[int]:
        """A prompt as `add_request` takes it, as token ids."""
        return self.processor.prompt_token_ids(prompt, add_special_tokens)

    @property
    def supports_images(self) -> bool:
        return self.processor.supports_images

    def process_multimodal(self, prompt: dict[str, Any], add_special_tokens: bool = True) -> dict[str, Any]:
        """A prompt dict with "multi_modal_data" run through the model's processor: the prompt
        dict `add_request` takes as it is ("prompt_token_ids" with the images' placeholders
        expanded, "prompt", "mm_features"). Safe to call from any thread (the server decodes
        and processes images off the engine thread); ValueError for what cannot be served."""
        return self.processor.process_multimodal(prompt, add_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, chat_template: str | None = None
    ) -> dict[str, Any]:
        """The conversation as a prompt: {"prompt": rendered text, "prompt_token_ids": ids}, with
        special tokens in user and tool contents tokenized as plain text (`portside.chat_template`)."""
        return self.processor.apply_chat_template(messages, add_generation_prompt, chat_template)

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
        and a call that only submitted returns no outputs. The step's KV events (blocks stored
        and evicted) are then published."""
        try:
            return self._step()
        finally:
            if self.kv_events is not None:
                self.kv_events.flush()

    def _step(self) -> list[RequestOutput]:
        if len(self._batches) < self.max_in_flight:
            so = self.scheduler.schedule()
            if not so.is_empty or so.finished_req_ids or so.kv_connector_metadata is not None:
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
        """Start filling the masks of the constrained requests that sample this step, one per
        position they sample (it runs while the model computes; the sampler waits for it)."""
        rows = []
        for rid, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            if req.structured is not None and req.num_computed_tokens + n >= req.num_tokens:
                rows.append((rid, req.structured, so.scheduled_spec_decode_tokens.get(rid, [])))
        return self.structured.grammar_bitmask(rows) if rows else None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._batches)

    def check_health(self) -> None:
        """RuntimeError when a rank of the executor has died: a step would fail, so an idle engine
        reports it now (the async engine calls this while idle). The executor has then stopped its
        remaining ranks."""
        self.executor.check_health()

    def stats(self) -> EngineStats:
        s = self.scheduler.make_stats()
        return EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_cache_usage=s.kv_cache_usage,
            num_used_blocks=round(s.kv_cache_usage * self.num_blocks),
            num_total_blocks=self.num_blocks,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            step_tokens=self.step_tokens,
            token_intervals=self.outputs.token_intervals,
            weight_bytes=self.weight_bytes,
            spec_decode=s.spec_decode,
            kv_transfer=s.kv_transfer,
        )

    def shutdown(self) -> None:
        self.structured.shutdown()
        self.executor.shutdown()
        if self.kv_events is not None:
            self.kv_events.shutdown()


def _blocks_per_request(block_size: int, max_model_len: int, max_batched: int, window: int | None) -> int:
    """Most blocks one request holds at once. Without a window: its whole length. With one:
    a step computing c <= min(budget, max_model_len) tokens holds at most the W - 1 tokens
    before them and the c tokens, over at most cdiv(W - 1 + c, block_size) + 1 blocks."""
    whole = -(-max_model_len // block_size)
    if window is None:
        return whole
    chunk = min(max_batched, max_model_len)
    return min(whole, -(-(window - 1 + chunk) // block_size) + 1)
