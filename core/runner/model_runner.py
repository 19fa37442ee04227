"""The model runner: turns a `SchedulerOutput` (block ids, token counts) into tensors, runs the
model through the platform's graph runner and attention backend, and samples.

It keeps a copy of each running request's tokens and blocks, updated from the scheduler's diffs
and from the tokens it samples itself, so per-step messages stay small.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from portside.config import EngineConfig
from portside.contract import (
    AttentionMetadata,
    Communicator,
    EagerGraphRunner,
    ForwardContext,
    KVCacheSpec,
    Platform,
    kv_cache_dtype_name,
    kv_cache_torch_dtype,
)
from portside.kv_cache.budget import kv_cache_budget
from portside.model.interface import is_multimodal
from portside.multimodal.inputs import MultiModalFeature
from portside.runner.pooler import PoolChunk, Pooler
from portside.sample.bitmask import TokenBitmask
from portside.sample.metadata import SamplingMetadata
from portside.sample.prompt_logprobs import PromptLogprobsRows, compute_prompt_logprobs
from portside.sampling_params import SamplingParams
from portside.sched.output import LogprobsLists, ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from portside.spec_decode.draft_model import DraftModelProposer
    from portside.spec_decode.ngram import NgramProposer

logger = logging.getLogger(__name__)


def _check_attention_features(model: object, platform: type[Platform], backend: object) -> None:
    """Refuse a model whose layers need an attention feature the backend declares unsupported."""
    refused: frozenset[str] = getattr(backend, "unsupported_features", frozenset())
    features = getattr(model, "attention_features", None)
    if not refused or features is None:
        return
    num_layers: int = getattr(model, "num_layers", None) or model.config.num_layers  # type: ignore[attr-defined]
    for i in range(num_layers):  # this pipeline stage's layers
        for name, value in features(i).items():
            if value is not None and name in refused:
                raise ValueError(
                    f"{model.config.architecture} needs attention feature {name!r} (layer {i}), which the "  # type: ignore[attr-defined]
                    f"{platform.name} platform's attention backend {getattr(backend, 'name', '?')!r} does not support"
                )


def _check_kv_cache_dtype(name: str, platform: type[Platform], backend: object) -> None:
    """Refuse an 8-bit cache the attention backend does not store: never silently the model dtype."""
    name = kv_cache_dtype_name(name)
    listed: frozenset[str] = getattr(backend, "kv_cache_dtypes", frozenset({"auto"}))
    if name != "auto" and name not in listed:
        raise ValueError(
            f"--kv-cache-dtype {name}: the {platform.name} platform's attention backend {getattr(backend, 'name', '?')!r} "
            f"stores only {sorted(listed)}; use --kv-cache-dtype auto"
        )


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    lora_request: Any = None  # a portside.lora.request.LoRARequest
    mm_features: list[MultiModalFeature] = dataclasses.field(default_factory=list)
    mrope: tuple[torch.Tensor, int] | None = None  # (prompt positions [3, P], delta): `SupportsMultiModal`

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]


@dataclass
class BatchInputs:
    req_ids: list[str]  # batch order: decodes first
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [num_rows]: rows of hidden states to sample from
    sampled_req_ids: list[str]  # requests whose chunk reaches their last known token
    # speculative decoding: per sampled request, the proposals it verifies (its rows in
    # logits_indices are 1 + len of them: its last token's, then each proposal's)
    spec: list[list[int]] = dataclasses.field(default_factory=list)
    # prompt_logprobs: the rows of requests that asked, their targets (the next prompt tokens)
    prompt_rows: list[PromptLogprobsRows] = dataclasses.field(default_factory=list)
    prompt_indices: torch.Tensor | None = None  # [M] rows of hidden states, after logits_indices
    prompt_targets: torch.Tensor | None = None  # [M] int64
    # image rows: (first batch row, feature, first and end embedding row) per image slice in the step
    mm_rows: list[tuple[int, MultiModalFeature, int, int]] = dataclasses.field(default_factory=list)


class ModelRunner:
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
        from portside.model.registry import load_model

        self.config = config
        self.platform = platform
        self.comm = comm
        self.eos_token_id = eos_token_id
        platform.set_device(local_rank)
        self.device = platform.device(local_rank)
        par = config.parallel
        tp = par.tensor_parallel_size
        self.rank = rank
        self.pp_rank, self.pp_size = rank // tp, par.pipeline_parallel_size
        self.is_last_stage = self.pp_rank == self.pp_size - 1
        if config.lora is not None and not platform.supports_lora:
            raise ValueError(f"LoRA adapters (enable_lora) are not supported on the {platform.name} platform")
        if self.pp_size > 1 and not platform.supports_pipeline_parallel:
            raise ValueError(f"pipeline parallelism (pipeline_parallel_size {self.pp_size}) is not supported on the "
                             f"{platform.name} platform")
        ops = platform.model_ops(config)
        self.model = load_model(config.model, self.device, comm, tp_rank=rank % tp, tp_size=tp, ops=ops,
                                pp_rank=self.pp_rank, pp_size=self.pp_size, pipeline_layers=par.pipeline_layers)
        platform.prepare_model(cast(torch.nn.Module, self.model), config)
        self.lora = None
        if config.lora is not None:
            from portside.lora.manager import LoRAModelManager

            self.lora = LoRAModelManager(cast(torch.nn.Module, self.model), config.lora, ops)
        from portside.quant.apply import weight_bytes

        self.weight_bytes = weight_bytes(cast(torch.nn.Module, self.model))  # after the platform's re-layout
        q = config.model.quantization
        logger.info("model weights: %.1f MiB on %s (%s)", self.weight_bytes / 2**20, self.device,
                    q.describe() if q else str(config.model.dtype).removeprefix("torch."))
        self.vocab_size = self.model.config.vocab_size
        self.attn_backend = platform.attention_backend(config)
        _check_attention_features(self.model, platform, self.attn_backend)
        _check_kv_cache_dtype(config.cache.kv_cache_dtype, platform, self.attn_backend)
        self.kv_cache_dtype = kv_cache_torch_dtype(config.cache.kv_cache_dtype, self.model.kv_cache_spec().dtype)
        # an fp8 cache stores K / k_scale and V / v_scale (a checkpoint's per-layer scales, else 1)
        use_scales = getattr(self.model, "use_kv_scales", None)
        if use_scales is not None:
            use_scales(self.kv_cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2))
        # the model itself: callable as ModelFn, and a PiecewiseModel for graph runners that need one
        if self.lora is None:
            self.graph_runner = platform.graph_runner(self.model, config)
            if self.pp_size > 1 and not self.graph_runner.supports_pipeline_stages:
                logger.info("pipeline parallelism: the %s graph runner cannot run a stage; the stage runs eagerly",
                            self.graph_runner.name)
                self.graph_runner = EagerGraphRunner(self.model, config)
        else:  # a step's adapters are data the platforms' captured graphs and fused steps do not take
            logger.info("LoRA: the model runs eagerly (no graph capture or fused decode steps)")
            self.graph_runner = EagerGraphRunner(self.model, config)
        # vision-language models: steps with image rows run in a runner that reads `stage_input`
        # (graph runners that capture the embedding embed token ids themselves); with 3-D rotary
        # positions (mrope) every step does
        self.multimodal = is_multimodal(self.model)
        self.encoder_cache = None
        if self.multimodal:
            from portside.multimodal.encoder_cache import EncoderCache

            self.encoder_cache = EncoderCache(config.multimodal.encoder_cache_size)
            # a runner that reads `stage_input` (pipeline stages) takes merged image embeddings too
            self.eager_runner = self.graph_runner if self.graph_runner.supports_pipeline_stages \
                else EagerGraphRunner(self.model, config)
            if getattr(self.model, "uses_mrope", False) and not self.graph_runner.supports_pipeline_stages:
                logger.info("%s: 3-D rotary positions; the model runs eagerly", self.model.config.architecture)
                self.graph_runner = self.eager_runner
        self.sampler = platform.sampler(config)
        # task embed: every request ends with its pooled prompt (`pooler`), never samples
        self.pooler = Pooler(config.model.pooler) if config.model.pooler is not None else None
        assert config.cache.block_size is not None
        self.block_size: int = config.cache.block_size
        self.requests: dict[str, CachedRequestState] = {}
        self.kv_caches: list[torch.Tensor] = []
        self.scratch_block = -1  # a block never handed out, for padded graph entries
        self._last_sampling: tuple[list[tuple[str, int]], SamplingMetadata] | None = None  # see _sampling_metadata
        # speculative decoding: one proposer, prompt lookup or a draft model
        self.ngram: NgramProposer | None = None
        self.draft: DraftModelProposer | None = None
        if config.speculative is not None and config.speculative.method == "draft_model":
            from portside.spec_decode.draft_model import DraftModelProposer

            self.draft = DraftModelProposer(config, platform, comm, self.device, rank, self.attn_backend,
                                            self.block_size, self.vocab_size)
        elif config.speculative is not None:
            from portside.spec_decode.ngram import NgramProposer

            self.ngram = NgramProposer(config.speculative)
        from portside.spec_decode.backoff import ProposalBackoff

        self.backoff = ProposalBackoff()

    # ---- KV cache ---------------------------------------------------------------------------

    def kv_cache_spec(self) -> KVCacheSpec:
        spec = self.model.kv_cache_spec()
        return spec if self.kv_cache_dtype == spec.dtype else dataclasses.replace(spec, cache_dtype=self.kv_cache_dtype)

    def determine_num_blocks(self) -> int:
        """Blocks that fit the configured KV-cache memory (or exactly `num_kv_blocks`)."""
        cache = self.config.cache
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        per_block = self.kv_cache_spec().bytes_per_block(self.block_size)
        if self.draft is not None:  # the draft's KV lives in the same blocks
            per_block += self.draft.kv_cache_spec().bytes_per_block(self.block_size)
        budget = kv_cache_budget(cache, self.platform.device_info(), self.platform.default_kv_cache_memory)
        num_blocks = int(budget // per_block)
        # Never more than every sequence at full length, twice over (the rest is prefix cache).
        blocks_per_seq = -(-self.config.model.max_model_len // self.block_size)
        cap = 2 * self.config.scheduler.max_num_seqs * blocks_per_seq
        if num_blocks > cap:
            num_blocks = cap
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB, %s)", num_blocks, self.block_size,
                    num_blocks * per_block / 2**20, str(self.kv_cache_spec().storage_dtype).removeprefix("torch."))
        return num_blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_caches(self.attn_backend, self.kv_cache_spec(), num_blocks, self.block_size, self.device)
        self.scratch_block = num_blocks
        with self.platform.inference_mode():
            self.graph_runner.capture(self._dummy_decode_context)
        if self.draft is not None:
            self.draft.initialize_kv_cache(num_blocks)

    def _dummy_decode_context(self, num_decodes: int) -> ForwardContext:
        return dummy_decode_context(self.attn_backend, self.kv_caches, self.scratch_block, self.block_size, self.device,
                                    num_decodes)

    # ---- one step ---------------------------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        if scheduler_output.is_empty:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids={})
        batch = self._prepare_inputs(scheduler_output)
        if self.lora is not None:
            counts = scheduler_output.num_scheduled_tokens
            self.lora.set_batch([self.requests[r].lora_request for r in batch.req_ids], [counts[r] for r in batch.req_ids],
                                self.device)
        last = self.is_last_stage
        with self.platform.inference_mode():
            ctx = ForwardContext(self.attn_backend, self.kv_caches, self.attn_backend.prepare(batch.metadata))
            if self.pp_rank > 0:  # the previous stage's hidden states, from the same TP rank there
                h = torch.empty(len(batch.input_ids), self.model.config.hidden_size, dtype=self.model.dtype,  # type: ignore[attr-defined]
                                device=self.device)
                self.model.stage_input = self.comm.recv(h, src=self.rank - self.config.parallel.tensor_parallel_size)  # type: ignore[attr-defined]
            runner = self.graph_runner
            if batch.mm_rows and self.pp_rank == 0:
                self.model.stage_input = self._merge_images(batch)  # type: ignore[attr-defined]
                runner = self.eager_runner
            hidden = runner(batch.input_ids, batch.positions, ctx)
            if self.pp_rank > 0 or batch.mm_rows:
                self.model.stage_input = None  # type: ignore[attr-defined]
            if not last:
                self.comm.send(hidden, dst=self.rank + self.config.parallel.tensor_parallel_size)
            sampled: dict[str, list[int]] = {rid: [] for rid in batch.req_ids}
            logprobs: dict[str, LogprobsLists] = {}
            pooled: dict[str, list[float]] = {}
            prompt_lps: dict[str, tuple[int, LogprobsLists]] = {}
            if self.pooler is not None:
                if last:
                    pooled = self.pooler.step(hidden, self._pool_chunks(batch, scheduler_output.num_scheduled_tokens))
            elif last and (batch.sampled_req_ids or batch.prompt_rows):
                logits, prompt_lps = self._logits(hidden, batch)
            if self.pooler is None and batch.sampled_req_ids and last:
                states = [self.requests[rid] for rid in batch.sampled_req_ids]
                meta = self._sampling_metadata(states, batch.spec)
                out = self.sampler(logits, meta, self._token_bitmask(scheduler_output, batch))
                token_ids = out.sampled_token_ids  # [num_rows]
                if self.comm.world_size > 1:
                    # Every TP rank continues from the group's rank 0 tokens, whatever its own sampler drew.
                    token_ids = self.comm.broadcast(token_ids.contiguous(), src=0)
                rows = token_ids.tolist()
                row_lps = out.logprobs.tolists(meta.num_logprobs) if out.logprobs is not None else None
                row = 0
                for state, spec in zip(states, batch.spec):
                    new = accepted_tokens(rows[row : row + 1 + len(spec)], spec)
                    state.output_token_ids.extend(new)
                    sampled[state.req_id] = new
                    if row_lps is not None and row_lps[row] is not None:
                        logprobs[state.req_id] = _join_logprobs(row_lps[row : row + len(new)])
                    row += 1 + len(spec)
        spec_scheduled = scheduler_output.scheduled_spec_decode_tokens
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            state = self.requests[rid]
            state.num_computed_tokens += n
            if rid in spec_scheduled and last:  # rejected proposals: their slots are written again next step
                state.num_computed_tokens -= len(spec_scheduled[rid]) + 1 - len(sampled[rid])
                self.backoff.record(rid, len(spec_scheduled[rid]), len(sampled[rid]) - 1)
            # (an earlier pipeline stage gets the count after acceptance with the tokens, next step)
        return ModelRunnerOutput(req_ids=batch.req_ids, sampled_token_ids=sampled, logprobs=logprobs, pooled=pooled,
                                 prompt_logprobs=prompt_lps, spec_token_ids=self._propose(sampled))

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

    def _mrope_positions(self, state: CachedRequestState, start: int, end: int) -> torch.Tensor:
        """[3, end - start] positions of a request's tokens [start, end) under 3-D rotary."""
        if state.mrope is None:
            model: Any = self.model
            state.mrope = model.mrope_positions(state.prompt_token_ids, state.mm_features)
        prompt_pos, delta = state.mrope
        n = prompt_pos.shape[1]
        parts = []
        if start < n:
            parts.append(prompt_pos[:, start : min(end, n)])
        if end > n:
            later = torch.arange(max(start, n), end, dtype=torch.int64) + delta
            parts.append(later.expand(3, -1))
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]

    def _propose(self, sampled: dict[str, list[int]]) -> dict[str, list[int]]:
        """Speculative decoding: the next proposals of each request that sampled this step (none
        under a grammar, whose masks follow only the tokens actually accepted)."""
        if (self.ngram is None and self.draft is None) or not self.is_last_stage:
            return {}
        states = [self.requests[rid] for rid, new in sampled.items()
                  if new and self.requests[rid].sampling_params.structured_outputs is None and self.backoff.allows(rid)]
        if self.draft is not None:
            return self.draft.propose(states)
        assert self.ngram is not None
        proposals = {}
        for state in states:
            spec = self.ngram.propose(state.prompt_token_ids + state.output_token_ids)
            if spec:
                proposals[state.req_id] = spec
        return proposals

    def _logits(self, hidden: torch.Tensor, batch: BatchInputs) -> tuple[torch.Tensor, dict[str, tuple[int, LogprobsLists]]]:
        """The sampled rows' logits, and the prompt logprobs of the rows that asked: one LM head
        call for both (under tensor parallelism it gathers the vocabulary as the sampled path does)."""
        if batch.prompt_indices is None or batch.prompt_targets is None:
            return self.graph_runner.logits(hidden, batch.logits_indices), {}
        logits = self.graph_runner.logits(hidden, torch.cat([batch.logits_indices, batch.prompt_indices]))
        num_sampled = len(batch.logits_indices)
        return logits[:num_sampled], compute_prompt_logprobs(logits[num_sampled:], batch.prompt_targets, batch.prompt_rows)

    def _pool_chunks(self, batch: BatchInputs, counts: dict[str, int]) -> list[PoolChunk]:
        """Each request's rows of this step (before its computed count advances)."""
        qsl = batch.metadata.query_start_loc_cpu
        return [PoolChunk(rid, qsl[i], counts[rid], self.requests[rid].num_computed_tokens,
                          len(self.requests[rid].prompt_token_ids)) for i, rid in enumerate(batch.req_ids)]

    def _token_bitmask(self, so: SchedulerOutput, batch: BatchInputs) -> TokenBitmask | None:
        """The step's grammar masks (waiting for them here, after the forward) on the device."""
        if so.grammar is None:
            return None
        index, row = {}, 0
        for rid, spec in zip(batch.sampled_req_ids, batch.spec):  # a constrained request has no proposals
            index[rid] = row
            row += 1 + len(spec)
        rows = torch.tensor([index[rid] for rid in so.grammar.req_ids], dtype=torch.int64, device=self.device)
        return TokenBitmask(rows=rows, bitmask=so.grammar.get().to(self.device))

    def _sampling_metadata(self, states: list[CachedRequestState], spec: list[list[int]]) -> SamplingMetadata:
        """The step's sampling metadata, a row per sampled position: a request verifying proposals
        has one for its last token and one for each proposal, each row sampling as if the
        proposals before it were accepted (its output so far includes them: penalties, min_tokens
        and a seeded row's generator are then exactly those of the run without speculation).
        Last step's when it samples the same rows in the same order and nothing in it depends on
        the tokens sampled since (`SamplingMetadata.reusable`), as in a steady run of decodes;
        else built anew (the build costs ~0.1 ms a step at batch 1, more than the greedy sampling
        it feeds)."""
        layout = [(s.req_id, len(p)) for s, p in zip(states, spec)]
        if self._last_sampling is not None and self._last_sampling[0] == layout:
            return self._last_sampling[1]
        rows = [(s, s.output_token_ids + p[:j] if j else s.output_token_ids) for s, p in zip(states, spec)
                for j in range(len(p) + 1)]
        meta = SamplingMetadata.build(
            [s.sampling_params for s, _ in rows],
            [s.prompt_token_ids for s, _ in rows],
            [out for _, out in rows],
            eos_token_id=self.eos_token_id,
            vocab_size=self.vocab_size,
            device=self.device,
        )
        self._last_sampling = (layout, meta) if meta.reusable else None
        return meta

    def _update_states(self, so: SchedulerOutput) -> None:
        if so.finished_req_ids or so.scheduled_new_reqs:
            self._last_sampling = None  # a request id may come back as another request
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
            self.backoff.forget(rid)
            if self.draft is not None:
                self.draft.forget(rid)
            if self.pooler is not None:
                self.pooler.forget(rid)
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=list(new.prompt_token_ids),
                output_token_ids=list(new.output_token_ids),
                sampling_params=new.sampling_params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                lora_request=new.lora_request,
                mm_features=list(new.mm_features),
            )
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
            if not self.is_last_stage:  # the last stage's sampled tokens (it appended them itself)
                state.output_token_ids.extend(cached.new_token_ids)

    def _prepare_inputs(self, so: SchedulerOutput) -> BatchInputs:
        counts = so.num_scheduled_tokens
        # decodes (one query token) first, so attention backends can batch them
        req_ids = sorted(counts, key=lambda r: counts[r] != 1)
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens, qsl = [], [0]
        logits_rows: list[int] = []
        sampled: list[str] = []
        spec_of_sampled: list[list[int]] = []
        tables: list[list[int]] = []
        num_decodes = 0
        prompt_rows: list[PromptLogprobsRows] = []
        prompt_indices: list[int] = []
        prompt_targets: list[int] = []
        mrope: list[torch.Tensor] | None = [] if getattr(self.model, "uses_mrope", False) else None
        mm_rows: list[tuple[int, MultiModalFeature, int, int]] = []
        for rid in req_ids:
            state = self.requests[rid]
            start, n = state.num_computed_tokens, counts[rid]
            end = start + n
            blocks = state.block_ids
            spec = so.scheduled_spec_decode_tokens.get(rid, [])
            ids.extend(state.token_slice(start, end - len(spec)))
            ids.extend(spec)
            positions.extend(range(start, end))
            if mrope is not None:
                mrope.append(self._mrope_positions(state, start, end))
            for f in state.mm_features:  # images whose placeholder rows this chunk holds
                a, b = max(start, f.placeholder.offset), min(end, f.placeholder.end)
                if a < b:
                    mm_rows.append((len(ids) - n + a - start, f, a - f.placeholder.offset, b - f.placeholder.offset))
            if n == 1:  # plain Python for a single token: a numpy call costs more than its work
                slots.append(blocks[start // bs] * bs + start % bs)
                num_decodes += 1
            else:
                pos = np.arange(start, end, dtype=np.int64)
                slots.extend((np.asarray(blocks, dtype=np.int64)[pos // bs] * bs + pos % bs).tolist())
            seq_lens.append(end)
            qsl.append(qsl[-1] + n)
            tables.append(blocks)
            if end - len(spec) >= state.num_tokens:  # the chunk reaches the last known token: sample
                logits_rows.extend(range(qsl[-1] - 1 - len(spec), qsl[-1]))
                sampled.append(rid)
                spec_of_sampled.append(spec)
            k = state.sampling_params.prompt_logprobs
            # positions predicting a prompt token; none in a recompute after outputs (sent already)
            last = min(end, len(state.prompt_token_ids) - 1)
            if k is not None and start < last and not state.output_token_ids:
                prompt_rows.append(PromptLogprobsRows(rid, start, last - start, k))
                prompt_indices.extend(range(qsl[-2], qsl[-2] + last - start))
                prompt_targets.extend(state.prompt_token_ids[start + 1 : last + 1])
        d = self.device

        def tensor(values: list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=d)

        md = attention_metadata(tables, slots, qsl, seq_lens, num_decodes, bs, d)
        return BatchInputs(
            req_ids=req_ids,
            input_ids=tensor(ids, torch.int64),
            positions=tensor(positions, torch.int64) if mrope is None else torch.cat(mrope, dim=1).to(d),
            metadata=md,
            logits_indices=tensor(logits_rows, torch.int64),
            sampled_req_ids=sampled,
            spec=spec_of_sampled,
            prompt_rows=prompt_rows,
            prompt_indices=tensor(prompt_indices, torch.int64) if prompt_rows else None,
            prompt_targets=tensor(prompt_targets, torch.int64) if prompt_rows else None,
            mm_rows=mm_rows,
        )


def attention_metadata(tables: list[list[int]], slots: list[int], qsl: list[int], seq_lens: list[int],
                       num_decode_tokens: int, block_size: int, device: torch.device) -> AttentionMetadata:
    """A batch's metadata from per-sequence block tables (padded here), slots, query starts and
    lengths; the one-token queries first, `num_decode_tokens` of them."""
    table = np.zeros((len(tables), max(len(b) for b in tables)), dtype=np.int32)
    for i, b in enumerate(tables):
        table[i, : len(b)] = b
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.from_numpy(table).to(device),
        max_query_len=max(b - a for a, b in zip(qsl, qsl[1:])),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        num_decode_tokens=num_decode_tokens,
    )


def allocate_kv_caches(backend: Any, spec: KVCacheSpec, num_blocks: int, block_size: int,
                       device: torch.device) -> list[torch.Tensor]:
    """One cache per layer of `spec`, `num_blocks` blocks plus the scratch block (the last)."""
    dtype = spec.storage_dtype
    shape = backend.cache_shape(num_blocks + 1, block_size, spec.num_kv_heads, spec.head_size, dtype)
    return [backend.allocate_kv_cache(shape, dtype, device) for _ in range(spec.num_layers)]


def dummy_decode_context(backend: Any, kv_caches: list[torch.Tensor], scratch_block: int, block_size: int,
                         device: torch.device, num_decodes: int) -> ForwardContext:
    """A decode-only batch of `num_decodes` one-token requests writing to the scratch block (for capture)."""
    slot = scratch_block * block_size
    md = AttentionMetadata(
        slot_mapping=torch.full((num_decodes,), slot, dtype=torch.int64, device=device),
        query_start_loc=torch.arange(num_decodes + 1, dtype=torch.int32, device=device),
        seq_lens=torch.ones(num_decodes, dtype=torch.int32, device=device),
        block_tables=torch.full((num_decodes, 1), scratch_block, dtype=torch.int32, device=device),
        max_query_len=1,
        max_seq_len=1,
        block_size=block_size,
        query_start_loc_cpu=list(range(num_decodes + 1)),
        seq_lens_cpu=[1] * num_decodes,
        num_decode_tokens=num_decodes,
    )
    return ForwardContext(backend, kv_caches, backend.prepare(md))


def accepted_tokens(sampled: list[int], spec: list[int]) -> list[int]:
    """What a step yields for a request that verified `spec`: `sampled[j]` is the token drawn at
    the position after proposal j (j = 0: after its last token) as if proposals 0..j-1 were
    accepted. Proposal j is accepted when the draw before it equals it; the yield is the accepted
    proposals plus the first draw that disagrees, or the draw after the last proposal. With a
    deterministic proposer this is exact rejection sampling: proposal t is accepted with the
    target's probability p(t), and a rejection yields a draw from p conditioned on not t."""
    j = 0
    while j < len(spec) and sampled[j] == spec[j]:
        j += 1
    return sampled[: j + 1]


def _join_logprobs(rows: list[LogprobsLists | None]) -> LogprobsLists:
    """Consecutive one-token rows of one request as one multi-token LogprobsLists."""
    return LogprobsLists(token_ids=[ids for r in rows if r is not None for ids in r.token_ids],
                         logprobs=[lp for r in rows if r is not None for lp in r.logprobs],
                         sampled_ranks=[k for r in rows if r is not None for k in r.sampled_ranks])
