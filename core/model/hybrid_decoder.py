"""What a hybrid decoder (attention layers beside state-space layers) adds to `DecoderForCausalLM`:
layers that hold attention, a recurrent mixer or both, counted separately (attention layer a
calls ``ctx.attention(a, ...)``, recurrent layer r keeps its state in ``ctx.state_caches[r]``),
the KV-cache and state specs of this rank's share, and checkpoint loading through the decoder's
machinery (the mixers' parameters keep Hugging Face's names and cut their rank's rows from the
checkpoint's tensors themselves). Falcon-H1 and Jamba are built on it.

A layer module (`HybridLayer`) has ``self_attn`` (a `DecoderAttention`) where it attends, a mixer
under `HybridForCausalLM.mixer_name` where it keeps a state (with `state_shapes()`: (conv state,
SSM state) of one sequence on this rank), and
``forward(h, rope, ctx, attn_idx, state_idx) -> h``.
"""

from __future__ import annotations

from typing import Any, ClassVar, cast

import torch
from torch import nn

from portside.contract import Communicator, ForwardContext, KVCacheSpec, ModelOps, StateSpec
from portside.model.args import ModelArgs
from portside.model.decoder import TP, DecoderAttention, DecoderForCausalLM
from portside.model.decoder import MissingLayer as _Missing
from portside.model.layers import RMSNorm, VocabParallelEmbedding
from portside.model.pipeline import PipelineStage

__all__ = ["HybridForCausalLM", "HybridLayer", "NoRope"]

Rope = tuple[torch.Tensor, ...]


class HybridLayer(nn.Module):
    """One decoder layer of a hybrid model (see the module's docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.self_attn: DecoderAttention | None = None  # a layer that attends sets it

    def forward(self, h: torch.Tensor, rope: Rope, ctx: ForwardContext, attn_idx: int | None,
                state_idx: int | None) -> torch.Tensor:
        raise NotImplementedError


class NoRope(nn.Module):
    """Attention without positions (Jamba): a rotary of no dimensions (`apply_rotary` passes the
    head through)."""

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        empty = torch.empty(positions.shape[-1], 0, dtype=dtype, device=positions.device)
        return empty, empty


class HybridModel(nn.Module):
    """The parameters under `model.*`: embed_tokens, layers, norm (checkpoints' final_layernorm)."""

    def __init__(self, model_cls: type[HybridForCausalLM], args: ModelArgs, tp: TP, dtype: torch.dtype,
                 stage: PipelineStage) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size, tp.rank, tp.size, dtype, tp.comm) \
            if stage.is_first else None
        self.rotary = model_cls.make_rotary(args)
        self.rotary_local = None
        self.layers = nn.ModuleList(model_cls.make_layer(args, i, tp, dtype) if stage.start <= i < stage.end
                                    else _Missing() for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype) if stage.is_last else None


class HybridForCausalLM(DecoderForCausalLM):
    """Embedding, hybrid layers, final norm and LM head; loads Hugging Face checkpoints."""

    has_recurrent_state: ClassVar[bool] = True  # the runner runs the model eagerly, with state slots
    mixer_name: ClassVar[str] = "mamba"  # the recurrent mixer's attribute (and checkpoint name) in a layer
    state_kind: ClassVar[str] = "mamba"  # `StateSpec.kind`
    renames: ClassVar[tuple[tuple[str, str], ...]] = (("model.final_layernorm.", "model.norm."),)
    model_module = HybridModel

    def __init__(
        self,
        args: ModelArgs,
        comm: Communicator | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        dtype: torch.dtype = torch.float32,
        ops: ModelOps | None = None,
        stage: PipelineStage | None = None,
    ) -> None:
        super().__init__(args, comm, tp_rank, tp_size, dtype, ops, stage)
        # each layer's ordinal among this stage's attention layers and among its recurrent layers
        self._attn_idx: list[int | None] = []
        self._state_idx: list[int | None] = []
        for i in range(self.num_layers):
            layer = self._layer(i)
            self._attn_idx.append(sum(x is not None for x in self._attn_idx) if layer.self_attn is not None else None)
            self._state_idx.append(sum(x is not None for x in self._state_idx) if self._mixer(layer) is not None else None)

    # ---- what an architecture provides ------------------------------------------------------

    @classmethod
    def make_layer(cls, args: ModelArgs, i: int, tp: TP, dtype: torch.dtype) -> HybridLayer:
        raise NotImplementedError

    @classmethod
    def make_rotary(cls, args: ModelArgs) -> nn.Module:
        return NoRope()

    # ---- forward ----------------------------------------------------------------------------

    def _layer(self, i: int) -> HybridLayer:  # type: ignore[override]
        return cast(HybridLayer, self.model.layers[self.stage.start + i])

    def _mixer(self, layer: nn.Module) -> nn.Module | None:
        return cast(nn.Module | None, getattr(layer, self.mixer_name, None))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h, rope = self.embed(input_ids, positions, ctx.inputs_embeds)
        for i in range(self.num_layers):
            h = self._layer(i)(h, rope, ctx, self._attn_idx[i], self._state_idx[i])
        return self.final_norm(h)

    def pre_attention(self, i: int, h: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError(f"{type(self).__name__} runs whole (its recurrent layers are not cut at attention)")

    post_attention = pre_attention  # type: ignore[assignment]

    def attention_features(self, i: int) -> dict[str, Any]:
        """Layer i's attention features (the runner's feature check); none for a layer without attention."""
        attn = self._layer(i).self_attn
        return attn.features if attn is not None else {}

    # ---- caches -----------------------------------------------------------------------------

    def _attention_layers(self) -> list[DecoderAttention]:
        return [cast(DecoderAttention, self._layer(i).self_attn) for i in range(self.num_layers)
                if self._attn_idx[i] is not None]

    def kv_cache_spec(self) -> KVCacheSpec:
        attn = self._attention_layers()
        kv_heads = attn[0].num_kv_heads if attn else max(1, self.config.num_kv_heads // self.tp.size)
        return KVCacheSpec(num_layers=len(attn), num_kv_heads=kv_heads, head_size=self.config.head_dim, dtype=self.dtype)

    def state_spec(self) -> StateSpec:
        """Each recurrent layer's (conv state, SSM state): the conv's inputs in the model's dtype,
        the SSM state in `ModelArgs.ssm_state_dtype` (--mamba-ssm-cache-dtype, else the
        checkpoint config's mamba_ssm_cache_dtype, else the model's dtype)."""
        mixers: list[Any] = [self._mixer(self._layer(i)) for i in range(self.num_layers) if self._state_idx[i] is not None]
        if not mixers:
            return StateSpec(num_layers=0, shapes=(), dtypes=(), kind=self.state_kind)
        return StateSpec(num_layers=len(mixers), shapes=tuple(mixers[0].state_shapes()),
                         dtypes=(self.dtype, self.config.ssm_state_dtype(self.dtype)), kind=self.state_kind)

    def use_kv_scales(self, enabled: bool) -> None:
        for attn in self._attention_layers():
            attn.kv_scaled = enabled and bool(torch.any((attn.k_scale != 1) | (attn.v_scale != 1)))

    def check_loaded(self, loaded: set[tuple[str, object]]) -> None:
        """The decoder's check, naming missing tensors as the checkpoint does (before `renames`)."""
        try:
            super().check_loaded(loaded)
        except ValueError as e:
            message = str(e)
            for old, new in self.renames:
                message = message.replace(new, old)
            raise ValueError(message) from None
