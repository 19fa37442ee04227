"""The model runner: turns a `SchedulerOutput` (block ids, token counts) into tensors, runs the
model through the platform's graph runner and attention backend, and samples.

A step is three parts, each in its own module: input preparation (`runner.inputs`: the runner's
copy of each running request, updated from the scheduler's diffs and from the tokens it samples
itself, so per-step messages stay small; the step's ids, positions, slots and attention metadata),
the forward (here: the stage input, the graph runner, the send to the next pipeline stage), and
the sampling handoff (`runner.sampling`). The KV caches and the checks before them are
`runner.kv_cache`; pooling (task embed) is `runner.pooler`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, cast

import torch

from portside.config import EngineConfig
from portside.contract import (
    Communicator,
    EagerGraphRunner,
    ForwardContext,
    GraphRunner,
    KVCacheSpec,
    LatentKVCacheSpec,
    ModelOps,
    Platform,
    kv_cache_torch_dtype,
)
from portside.kv_cache.budget import kv_cache_budget
from portside.kv_cache.state import num_state_slots
from portside.lora.manager import LoRAModelManager
from portside.model.interface import is_multimodal
from portside.model.registry import load_model
from portside.multimodal.encoder_cache import EncoderCache
from portside.multimodal.inputs import MultiModalFeature
from portside.pooling.head import PoolingHead
from portside.quant.apply import weight_bytes
from portside.runner.inputs import BatchInputs, CachedRequestState, prepare_inputs, update_request_states
from portside.runner.kv_cache import (
    allocate_kv_caches,
    check_attention_features,
    check_kv_cache_dtype,
    check_latent_kv_cache_dtype,
    dummy_decode_context,
)
from portside.runner.kv_transfer import RunnerKVTransfer
from portside.runner.pooler import PoolChunk, Pooler
from portside.runner.recurrent import RecurrentStates, state_spec_of
from portside.runner.sampling import SamplingHandoff
from portside.runner.weight_updates import RunnerWeights
from portside.sched.output import ModelRunnerOutput, SchedulerOutput
from portside.spec_decode.backoff import ProposalBackoff
from portside.spec_decode.config import HEAD_METHODS
from portside.spec_decode.draft_model import DraftModelProposer
from portside.spec_decode.eagle import EagleProposer
from portside.spec_decode.ngram import NgramProposer

__all__ = ["ModelRunner"]

logger = logging.getLogger(__name__)


def _check_platform(config: EngineConfig, platform: type[Platform]) -> None:
    """Refuse what the platform declares it cannot run (LoRA adapters, pipeline stages)."""
    pp = config.parallel.pipeline_parallel_size
    if config.lora is not None and not platform.supports_lora:
        raise ValueError(f"LoRA adapters (enable_lora) are not supported on the {platform.name} platform")
    if pp > 1 and not platform.supports_pipeline_parallel:
        raise ValueError(f"pipeline parallelism (pipeline_parallel_size {pp}) is not supported on the "
                         f"{platform.name} platform")


class ModelRunner(RunnerWeights):
    def __init__(
        self,
        config: EngineConfig,
        platform: type[Platform],
        comm: Communicator,
        eos_token_id: int | None,
        rank: int = 0,
        local_rank: int = 0,
    ) -> None:
        """`rank` counts in the world of TP x PP ranks (`ParallelConfig`); `comm` is this rank's
        tensor-parallel group. Only the last pipeline stage samples; an earlier stage's runner
        learns the sampled tokens from the next `SchedulerOutput` (`CachedRequestData.new_token_ids`)."""
        self.config = config
        self.platform = platform
        self.comm = comm
        self.eos_token_id = eos_token_id
        platform.set_device(local_rank)
        self.device = platform.device(local_rank)
        tp = config.parallel.tensor_parallel_size
        self.rank = rank
        self.pp_rank, self.pp_size = rank // tp, config.parallel.pipeline_parallel_size
        self.is_last_stage = self.pp_rank == self.pp_size - 1
        _check_platform(config, platform)
        self._load_model(platform.model_ops(config))
        self._setup_attention()
        # a hybrid model's recurrent layers: their per-sequence states (allocated with the KV cache)
        self.state_spec = state_spec_of(self.model)
        self.states: RecurrentStates | None = None
        self._step_md: Any = None  # the step's RecurrentMetadata (verify rows are committed after sampling)
        self._setup_graph_runners()
        self.sampler = platform.sampler(config)
        self.sampler.logprobs_mode = config.model.logprobs_mode
        # task embed: every request ends with its pooled prompt (`pooler`), never samples
        self.pooler = Pooler(config.model.pooler, PoolingHead(config.model.pooler, self.model, self.device)) \
            if config.model.pooler is not None else None
        assert config.cache.block_size is not None
        self.block_size: int = config.cache.block_size
        self.requests: dict[str, CachedRequestState] = {}
        self.kv_caches: list[torch.Tensor] = []
        self.scratch_block = -1  # a block never handed out, for padded graph entries
        self.kv_transfer = RunnerKVTransfer()  # the KV connector's worker half (tiers, disaggregation), if any
        self.sampling = SamplingHandoff(self.sampler, comm, eos_token_id, self.vocab_size, self.device)
        self._setup_spec_decode()

    def _load_model(self, ops: ModelOps) -> None:
        """This rank's share of this stage's model, laid out by the platform, with LoRA slots."""
        config, par = self.config, self.config.parallel
        tp = par.tensor_parallel_size
        self.model = load_model(config.model, self.device, self.comm, tp_rank=self.rank % tp, tp_size=tp, ops=ops,
                                pp_rank=self.pp_rank, pp_size=self.pp_size, pipeline_layers=par.pipeline_layers,
                                mamba_ssm_cache_dtype=config.cache.mamba_ssm_cache_dtype)
        self.platform.prepare_model(cast(torch.nn.Module, self.model), config)
        if config.batch_invariant:  # its layers on core's batch-invariant kernels, or refused
            from portside.model.batch_invariant import make_batch_invariant

            make_batch_invariant(cast(torch.nn.Module, self.model))
        self.lora = LoRAModelManager(cast(torch.nn.Module, self.model), config.lora, ops) \
            if config.lora is not None else None
        self.weight_bytes = weight_bytes(cast(torch.nn.Module, self.model))  # after the platform's re-layout
        q = config.model.quantization
        logger.info("model weights: %.1f MiB on %s (%s)", self.weight_bytes / 2**20, self.device,
                    q.describe() if q else str(config.model.dtype).removeprefix("torch."))
        self.vocab_size = self.model.config.vocab_size

    def _setup_attention(self) -> None:
        """The platform's attention backend, checked against the model and the cache dtype."""
        config, platform = self.config, self.platform
        self.attn_backend = platform.attention_backend(config)
        check_attention_features(self.model, platform, self.attn_backend)
        check_kv_cache_dtype(config.cache.kv_cache_dtype, platform, self.attn_backend)
        check_latent_kv_cache_dtype(config.cache.kv_cache_dtype, self.model.kv_cache_spec(), self.model.config.architecture)
        self.kv_cache_dtype = kv_cache_torch_dtype(config.cache.kv_cache_dtype, self.model.kv_cache_spec().dtype)
        # an fp8 cache stores K / k_scale and V / v_scale (a checkpoint's per-layer scales, else 1)
        use_scales = getattr(self.model, "use_kv_scales", None)
        if use_scales is not None:
            use_scales(self.kv_cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2))

    def _setup_graph_runners(self) -> None:
        """The graph runner of every step, and of a vision-language model's steps with image rows."""
        config = self.config
        self.graph_runner: GraphRunner
        # the model itself: callable as ModelFn, and a PiecewiseModel for graph runners that need one
        if self.lora is None:
            self.graph_runner = self.platform.graph_runner(self.model, config)
            if self.pp_size > 1 and not self.graph_runner.supports_pipeline_stages:
                logger.info("pipeline parallelism: the %s graph runner cannot run a stage; the stage runs eagerly",
                            self.graph_runner.name)
                self.graph_runner = EagerGraphRunner(self.model, config)
            if self.state_spec is not None and not self.graph_runner.supports_recurrent_state:
                logger.info("%s: %d %s layers keep a recurrent state, which the %s graph runner does not run; "
                            "the model runs eagerly", self.model.config.architecture, self.state_spec.num_layers,
                            self.state_spec.kind, self.graph_runner.name)
                self.graph_runner = EagerGraphRunner(self.model, config)
            # latent attention (MLA) layers call the backend's `latent_attention`, not the model cut at its
            # attention calls that piecewise runners compile: op by op, unless the backend's graphs take it
            if isinstance(self.model.kv_cache_spec(), LatentKVCacheSpec) and not self.attn_backend.latent_graph_support \
                    and not self.graph_runner.supports_recurrent_state:
                logger.info("%s: latent attention (MLA), which the %s graph runner does not run; the model runs eagerly",
                            self.model.config.architecture, self.graph_runner.name)
                self.graph_runner = EagerGraphRunner(self.model, config)
        if getattr(self.model, "is_encoder_only", False):  # `portside.model.bert_base`: whole prompts, no cache
            logger.info("%s: an encoder-only model (bidirectional attention); it runs eagerly",
                        self.model.config.architecture)
            # a platform runner that runs op by op (the cpu backend's eager one, its linears in oneDNN) keeps it
            if self.lora is not None or not self.graph_runner.supports_recurrent_state:
                self.graph_runner = EagerGraphRunner(self.model, config)
        elif self.lora is not None:  # a step's adapters are data the platforms' captured graphs and fused steps do not take
            logger.info("LoRA: the model runs eagerly (no graph capture or fused decode steps)")
            self.graph_runner = EagerGraphRunner(self.model, config)
        if isinstance(draft := getattr(self, "draft", None), EagleProposer):  # rebuilt after a weight update
            self.graph_runner = draft.use_runner(self.graph_runner)
        # vision-language models: steps with image rows run in a runner that passes the step's
        # `ForwardContext.inputs_embeds` on (graph runners that capture the embedding embed token
        # ids themselves); with 3-D rotary positions (mrope) every step does
        self.multimodal = is_multimodal(self.model)
        self.encoder_cache = None
        mrope = getattr(self.model, "uses_mrope", False)
        self._mrope_model: Any = self.model if mrope else None  # `prepare_inputs`: 3-D positions
        if self.multimodal:
            self.encoder_cache = EncoderCache(config.multimodal.encoder_cache_size)
            # a runner that takes a stage's input (pipeline stages) takes merged image embeddings too
            self.eager_runner = self.graph_runner if self.graph_runner.supports_pipeline_stages \
                else EagerGraphRunner(self.model, config)
            if mrope and not self.graph_runner.supports_pipeline_stages:
                logger.info("%s: 3-D rotary positions; the model runs eagerly", self.model.config.architecture)
                self.graph_runner = self.eager_runner

    def _setup_spec_decode(self) -> None:
        """Speculative decoding: one proposer, prompt lookup or a draft model."""
        config = self.config
        if config.speculative is not None and self.state_spec is not None and self.pp_size > 1:
            # an earlier stage learns the accepted count a step late, after its states moved on
            raise ValueError(f"speculative decoding with pipeline parallelism is not supported for "
                             f"{self.model.config.architecture}: its {self.state_spec.kind} layers keep a recurrent "
                             "state that each stage must roll back to the accepted proposals in the same step; drop "
                             "--speculative-config or --pipeline-parallel-size")
        self.ngram: NgramProposer | None = None
        self.draft: DraftModelProposer | EagleProposer | None = None
        if config.speculative is not None and config.speculative.method == "draft_model":
            self.draft = DraftModelProposer(config, self.platform, self.comm, self.device, self.rank, self.attn_backend,
                                            self.block_size, self.vocab_size)
        elif config.speculative is not None and config.speculative.method in HEAD_METHODS:
            if self.pp_size > 1:
                raise ValueError(f"speculative_config: method {config.speculative.method!r} with pipeline parallelism "
                                 "is not supported")
            self.draft = EagleProposer(config, self.platform, self.model, self.device, self.attn_backend,
                                       self.block_size, self.requests)
            # the head in the runner's eager kernels; EAGLE-3: the target's aux hidden states, op by op
            self.graph_runner = self.draft.use_runner(self.graph_runner)
        elif config.speculative is not None:
            self.ngram = NgramProposer(config.speculative)
        self.backoff = ProposalBackoff()

    # ---- KV cache ---------------------------------------------------------------------------

    def kv_cache_spec(self) -> KVCacheSpec:
        spec = self.model.kv_cache_spec()
        return spec if self.kv_cache_dtype == spec.dtype else dataclasses.replace(spec, cache_dtype=self.kv_cache_dtype)

    @property
    def num_spare_state_slots(self) -> int:
        """Slots for the per-token states of a step's verify rows (speculative decoding with
        recurrent layers: `runner.recurrent`): k per request, at most one per token of a step."""
        spec = self.config.speculative
        if self.state_spec is None or spec is None:
            return 0
        sched = self.config.scheduler
        return min(sched.max_num_seqs * spec.num_speculative_tokens, sched.max_num_batched_tokens)

    @property
    def num_state_slots(self) -> int:
        """State slots of the recurrent layers (0 without): as many as the scheduler hands out."""
        if self.state_spec is None:
            return 0
        return num_state_slots(self.config.scheduler.max_num_seqs, self.config.cache.enable_prefix_caching)

    def determine_num_blocks(self) -> int:
        """Blocks that fit the configured KV-cache memory (or exactly `num_kv_blocks`), after the
        recurrent layers' state slots (a hybrid model's) have taken theirs."""
        cache = self.config.cache
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        per_block = self.kv_cache_spec().bytes_per_block(self.block_size)
        if self.draft is not None:  # the draft's KV lives in the same blocks
            per_block += self.draft.kv_cache_spec().bytes_per_block(self.block_size)
        budget = kv_cache_budget(cache, self.platform.device_info(), self.platform.default_kv_cache_memory)
        state_bytes = self._state_bytes(budget)
        # Never more than every sequence at full length, twice over (the rest is prefix cache).
        blocks_per_seq = -(-self.config.model.max_model_len // self.block_size)
        cap = 2 * self.config.scheduler.max_num_seqs * blocks_per_seq
        num_blocks = min(cap, int((budget - state_bytes) // per_block)) if per_block else cap
        spec = self.kv_cache_spec()
        latent = (f"; latent attention (MLA): one row of {spec.latent_dim} + {spec.rope_dim} values per token and layer, "
                  f"{spec.bytes_per_token / 2**10:.1f} KiB per token, {num_blocks * self.block_size} tokens"
                  if isinstance(spec, LatentKVCacheSpec) else "")  # fmt: skip
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB, %s)%s%s", num_blocks, self.block_size,
                    num_blocks * per_block / 2**20, str(spec.storage_dtype).removeprefix("torch."), latent,
                    self._state_report(state_bytes, num_blocks))
        return num_blocks

    def _state_bytes(self, budget: float) -> int:
        """The recurrent layers' state slots, in bytes; refused when they alone exceed the budget."""
        if self.state_spec is None:
            return 0
        need = (self.num_state_slots + 1 + self.num_spare_state_slots) * self.state_spec.bytes_per_slot
        if need > budget:
            spare = f" and {self.num_spare_state_slots} speculative positions" if self.num_spare_state_slots else ""
            raise ValueError(
                f"the recurrent state of {self.num_state_slots} sequences{spare} ({self.state_spec.num_layers} "
                f"{self.state_spec.kind} layers, {self.state_spec.bytes_per_slot / 2**20:.2f} MiB each) needs "
                f"{need / 2**20:.0f} MiB, more than the KV cache's {budget / 2**20:.0f} MiB; lower --max-num-seqs "
                "or raise --kv-cache-memory")
        return need

    def _state_report(self, state_bytes: int, num_blocks: int) -> str:
        """The budget line's recurrent part: state slots, and how many sequences of max_model_len fit."""
        if self.state_spec is None:
            return ""
        max_len = self.config.model.max_model_len
        seq_blocks = -(-max_len // self.block_size)
        kv_layers = self.kv_cache_spec().num_layers
        fit = min(self.config.scheduler.max_num_seqs, num_blocks // seq_blocks if kv_layers else num_blocks)
        return (f" + {self.num_state_slots} state slots for {self.state_spec.num_layers} {self.state_spec.kind} "
                f"layers ({state_bytes / 2**20:.1f} MiB, {self.state_spec.bytes_per_slot / 2**10:.1f} KiB per "
                f"sequence); {fit} sequences of {max_len} tokens fit at once")

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._allocate_kv(num_blocks)
        with self.platform.inference_mode():
            self.graph_runner.capture(self._dummy_decode_context)

    def _allocate_kv(self, num_blocks: int) -> None:
        """The KV caches (a draft's too, in the same block ids, and recurrent state slots) of
        `num_blocks` blocks, plus the scratch block."""
        self.kv_caches = allocate_kv_caches(self.attn_backend, self.kv_cache_spec(), num_blocks, self.block_size, self.device)
        self.scratch_block = num_blocks
        draft = None
        if self.draft is not None:
            self.draft.initialize_kv_cache(num_blocks)
            draft = (self.draft.kv_cache_spec(), self.draft.kv_caches)
        self.kv_transfer.setup(self.config, self.platform, self.attn_backend, self.kv_cache_spec(), self.kv_caches,
                               self.block_size, self.rank, draft)
        if self.state_spec is not None:
            self.states = RecurrentStates(self.state_spec, self.num_state_slots, self.device, self.num_spare_state_slots)

    def _dummy_decode_context(self, num_decodes: int) -> ForwardContext:
        ctx = dummy_decode_context(self.attn_backend, self.kv_caches, self.scratch_block, self.block_size, self.device,
                                   num_decodes)
        if self.states is not None:  # every dummy request in the scratch slot, from zeros
            md = ctx.metadata
            ctx.state_caches = self.states.tensors
            ctx.recurrent = self.states.metadata([self.states.num_slots] * num_decodes, [False] * num_decodes,
                                                 md.query_start_loc, md.query_start_loc_cpu, num_decodes)
        return ctx

    # ---- one step: prepare -> forward -> sampling handoff -----------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        so = scheduler_output
        self._update_states(so)
        self.kv_transfer.start_step(so.kv_connector_metadata)
        if so.is_empty:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids={},
                                     kv_connector_output=self.kv_transfer.finish_step(so.kv_connector_metadata))
        if self._graphs_stale:  # the weights changed (an update, a wake-up): `RunnerWeights`
            self._rebuild_graphs()
        batch = prepare_inputs(self.requests, so, self.block_size, self.device, self._mrope_model)
        if self.lora is not None:
            counts = so.num_scheduled_tokens
            self.lora.set_batch([self.requests[r].lora_request for r in batch.req_ids], [counts[r] for r in batch.req_ids],
                                self.device)
        with self.platform.inference_mode():
            if self.states is not None:
                self.states.copy(so.state_copies_before)
            hidden = self._forward(batch, so)
            out = self._handoff(hidden, batch, so)
            if self.states is not None and self._step_md is not None and self._step_md.keeps_token_states:
                # verify rows: each slot back to the state after the accepted proposals
                self.states.commit(self._step_md, [len(out.sampled_token_ids.get(rid) or [1]) - 1
                                                   for rid in batch.req_ids])
            if isinstance(self.draft, EagleProposer):  # the head reads the target's hidden states of the step
                self.draft.observe(so, batch, hidden, out.sampled_token_ids)
            if self.states is not None:
                self.states.copy(so.state_copies_after)
        self._advance(so, out.sampled_token_ids)
        out.spec_token_ids = self._propose(out.sampled_token_ids)
        out.kv_connector_output = self.kv_transfer.finish_step(so.kv_connector_metadata)
        return out

    def kv_transfer_info(self) -> Any:
        """The KV connector's `KVTransferInfo` (None without one), for the scheduler's half."""
        return self.kv_transfer.info

    def _update_states(self, so: SchedulerOutput) -> None:
        if so.finished_req_ids or so.scheduled_new_reqs:
            self.sampling.reset()  # a request id may come back as another request
        for rid in so.finished_req_ids:
            self.backoff.forget(rid)
            if self.draft is not None:
                self.draft.forget(rid)
            if self.pooler is not None:
                self.pooler.forget(rid)
        # the last stage's sampled tokens: it appended them itself
        update_request_states(self.requests, so, append_tokens=not self.is_last_stage)

    def _stage_input(self, batch: BatchInputs) -> torch.Tensor | None:
        """What the model takes in place of its token embeddings this step
        (`ForwardContext.inputs_embeds`): on a later pipeline stage the previous stage's hidden
        states, from the same TP rank there; on the first, in a step with image rows, the step's
        token embeddings with the images' merged in; else None (the model embeds the ids)."""
        if self.pp_rank > 0:
            h = torch.empty(len(batch.input_ids), self.model.config.hidden_size, dtype=self.model.dtype,  # type: ignore[attr-defined]
                            device=self.device)
            return self.comm.recv(h, src=self.rank - self.config.parallel.tensor_parallel_size)
        if batch.mm_rows:
            return self._merge_images(batch)
        return None

    def _forward(self, batch: BatchInputs, so: SchedulerOutput) -> torch.Tensor:
        """This stage's hidden states [T, hidden] (sent on to the next stage, if any)."""
        metadata = self.attn_backend.prepare(batch.metadata)
        ctx = ForwardContext(self.attn_backend, self.kv_caches, metadata, inputs_embeds=self._stage_input(batch),
                             token_type_ids=batch.token_type_ids)
        if self.states is not None:
            self._step_md = self._recurrent_metadata(batch, so)
            ctx.state_caches, ctx.recurrent = self.states.tensors, self._step_md
        runner = self.eager_runner if batch.mm_rows and self.pp_rank == 0 else self.graph_runner
        hidden = runner(batch.input_ids, batch.positions, ctx)
        if not self.is_last_stage:
            self.comm.send(hidden, dst=self.rank + self.config.parallel.tensor_parallel_size)
        return hidden

    def _recurrent_metadata(self, batch: BatchInputs, so: SchedulerOutput) -> Any:
        """The step's `RecurrentMetadata`: each request's state slot, whether it continues a state,
        and the proposals it verifies (their per-token states are kept until `commit`)."""
        assert self.states is not None
        states = [self.requests[rid] for rid in batch.req_ids]
        md = batch.metadata
        spec = so.scheduled_spec_decode_tokens
        verified = [len(spec.get(rid, ())) for rid in batch.req_ids] if spec else None
        return self.states.metadata([s.state_slot for s in states], [s.num_computed_tokens > 0 for s in states],
                                    md.query_start_loc, md.query_start_loc_cpu, md.num_decode_tokens, verified)

    def _handoff(self, hidden: torch.Tensor, batch: BatchInputs, so: SchedulerOutput) -> ModelRunnerOutput:
        """The step's output: on the last stage the pooled vectors, or the sampled tokens with
        their logprobs and the prompt logprobs; on an earlier stage no token yet."""
        sampled: dict[str, list[int]] = {rid: [] for rid in batch.req_ids}
        out = ModelRunnerOutput(req_ids=batch.req_ids, sampled_token_ids=sampled)
        if not self.is_last_stage:
            return out
        if self.pooler is not None:
            out.pooled = self.pooler.step(hidden, self._pool_chunks(batch, so.num_scheduled_tokens))
        elif batch.sampled_req_ids or batch.prompt_rows:
            logits, out.prompt_logprobs = self.sampling.logits(self.graph_runner, hidden, batch)
            if batch.sampled_req_ids:
                states = [self.requests[rid] for rid in batch.sampled_req_ids]
                new, out.logprobs = self.sampling.sample(logits, states, batch, so)
                sampled.update(new)
        return out

    def _advance(self, so: SchedulerOutput, sampled: dict[str, list[int]]) -> None:
        """Each scheduled request's computed count after the step (proposals rejected: not counted)."""
        spec_scheduled = so.scheduled_spec_decode_tokens
        for rid, n in so.num_scheduled_tokens.items():
            state = self.requests[rid]
            state.num_computed_tokens += n
            if rid in spec_scheduled and self.is_last_stage:  # rejected proposals: their slots are written again next step
                state.num_computed_tokens -= len(spec_scheduled[rid]) + 1 - len(sampled[rid])
                self.backoff.record(rid, len(spec_scheduled[rid]), len(sampled[rid]) - 1)
            # (an earlier pipeline stage gets the count after acceptance with the tokens, next step)

    def _pool_chunks(self, batch: BatchInputs, counts: dict[str, int]) -> list[PoolChunk]:
        """Each request's rows of this step (before its computed count advances)."""
        qsl = batch.metadata.query_start_loc_cpu
        return [PoolChunk(rid, qsl[i], counts[rid], self.requests[rid].num_computed_tokens,
                          len(self.requests[rid].prompt_token_ids)) for i, rid in enumerate(batch.req_ids)]

    def _propose(self, sampled: dict[str, list[int]]) -> dict[str, list[int]]:
        """Speculative decoding: the next proposals of each request that sampled this step (under
        a grammar the scheduler keeps the prefix the grammar allows, and masks each verified
        position with the grammar's state after the proposals before it)."""
        if (self.ngram is None and self.draft is None) or not self.is_last_stage:
            return {}
        states = [self.requests[rid] for rid, new in sampled.items() if new and self.backoff.allows(rid)]
        if self.draft is not None:
            return self.draft.propose(states)
        assert self.ngram is not None
        proposals = {}
        for state in states:
            spec = self.ngram.propose(state.prompt_token_ids + state.output_token_ids)
            if spec:
                proposals[state.req_id] = spec
        return proposals

    # ---- vision-language models: the first stage's input embeddings ------------------------

    def _merge_images(self, batch: BatchInputs) -> torch.Tensor:
        """The step's embeddings [T, hidden]: the tokens', with image placeholder rows replaced
        by the images' embeddings (encoded now, or from the encoder cache)."""
        assert self.encoder_cache is not None
        model: Any = self.model
        embeds = model.embed_input_ids(batch.input_ids)
        missing = list({f.identifier: f for _, f, _, _ in batch.mm_rows if f.identifier not in self.encoder_cache}.values())
        for f, emb in zip(missing, self._encode_images(missing), strict=True):
            self.encoder_cache.add(f, emb)
        for row, feature, a, b in batch.mm_rows:  # (an image evicted meanwhile by a later one is encoded again)
            emb = self.encoder_cache.get(feature, lambda f: self._encode_images([f])[0])
            embeds[row : row + b - a] = emb[a:b].to(embeds.dtype)
        return embeds

    def _encode_images(self, features: list[MultiModalFeature]) -> list[torch.Tensor]:
        """Each image's embeddings, in as few vision-tower calls as the model can (`embed_images`)."""
        model: Any = self.model
        datas = [{k: v.to(self.device) for k, v in f.data.items()} for f in features]
        attention = self.attn_backend.encoder_attention
        if len(datas) > 1 and hasattr(model, "embed_images"):
            return list(model.embed_images(datas, attention))
        return [model.embed_image(d, attention) for d in datas]
