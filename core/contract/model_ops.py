"""Model ops: the kernels of model layers other than attention (`ModelOps`), each defaulting to
core's pure-torch reference (`portside.ops.moe`, `portside.ops.lora`, `portside.quant.weight`),
and the data they take: `LoRAMapping` and the canonical quantized weight, `QuantWeight` (with
the helpers a kernel needs to read or produce its layout).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, ClassVar

import torch

from portside.contract.recurrent import RecurrentKernels
from portside.ops import lora, moe
from portside.ops.lora import LoRAMapping
from portside.quant import weight as quant_weight
from portside.quant.weight import QuantParts, QuantWeight, pack_int4, quantize_activation, unpack_int4

MOE_ACTIVATIONS = moe.ACTIVATIONS
"""Expert activations of the plain gated form ``act(gate) * up``."""
MOE_CLAMPED_ACTIVATIONS = moe.CLAMPED_ACTIVATIONS
"""gpt-oss's clamped "swiglu_oai" (`ModelOps.activate` with `up`, alpha and limit)."""
SWIGLU_OAI_ALPHA = moe.SWIGLU_OAI_ALPHA

__all__ = [
    "LoRAMapping",
    "ModelOps",
    "QuantParts",
    "QuantWeight",
    "pack_int4",
    "quantize_activation",
    "unpack_int4",
]


class ModelOps(RecurrentKernels):
    """Kernels of model layers other than attention (`Platform.model_ops`). Every method's
    default is core's pure-torch reference (`portside.ops`), so a platform that overrides none
    runs every model correctly; a backend overrides what it has a faster kernel for, and the
    conformance kit tests each override against the reference.

    Mixture-of-experts (shapes in `portside.ops.moe`): `fused_moe` routes (`select_experts`)
    then computes the experts (`moe_experts`); a backend usually overrides `moe_experts` only.

    Quantized weights (`QuantWeight`, canonical layouts in `portside.quant.weight`):
    `prepare_quantized` re-lays a loaded weight once, `quantized_linear` multiplies by it; a
    backend overrides the formats it has kernels for and hands the rest to ``super()``.

    Batched multi-LoRA (shapes in `portside.ops.lora`): `lora_shrink` multiplies each token by
    its adapter slot's A, `lora_expand` adds its product with the slot's B into a column range of
    the layer's output; the `LoRAMapping` (token -> slot) is shared by every layer of a step. On
    a platform with ``supports_lora = False`` neither is called.

    Recurrent layers (`RecurrentKernels`, `portside.contract.recurrent`): causal conv1d, the
    Mamba-2 and Mamba-1 scans and the gated delta rule, over per-sequence state slots.
    """

    name: ClassVar[str] = "reference"
    """The implementation's name, in logs."""

    # ---- mixture-of-experts (`portside.ops.moe`) ---------------------------------------------

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """An override of a mixture-of-experts method written before its keyword-only options
        existed (see `MOE_OPTIONS`) keeps working: called without them it runs as written; called
        with one it cannot take, the reference runs instead (a plugin is never handed an option
        it would ignore, nor crashes on one)."""
        super().__init_subclass__(**kwargs)
        for name, options in MOE_OPTIONS.items():
            method = next(k.__dict__[name] for k in cls.__mro__ if name in k.__dict__)  # ModelOps declares it
            if method is ModelOps.__dict__[name] or getattr(method, "_moe_options_wrapped", False):
                continue
            try:
                params = inspect.signature(method).parameters
            except (TypeError, ValueError):  # not a plain function: left as it is
                continue
            if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
                continue
            missing = tuple(option for option in options if option not in params)
            if missing:
                setattr(cls, name, _fall_back_on_new_options(name, method, missing))

    @staticmethod
    def activate(
        gate: torch.Tensor,
        activation: str,
        up: torch.Tensor | None = None,
        *,
        swiglu_alpha: float = moe.SWIGLU_OAI_ALPHA,
        swiglu_limit: float = 7.0,
    ) -> torch.Tensor:
        """An expert's activation by name ("silu", "gelu_tanh"), for kernels that need it in torch;
        with `up`, the gated product (the only form of the clamped "swiglu_oai")."""
        return moe.activate(gate, activation, up, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)

    def select_experts(
        self,
        router_logits: torch.Tensor,
        top_k: int,
        renormalize: bool,
        scoring: str = "softmax",
        *,
        num_groups: int = 1,
        topk_groups: int | None = None,
        group_scoring: str = "max",
        correction_bias: torch.Tensor | None = None,
        scaling_factor: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """router_logits [T, E] -> (weights [T, top_k] fp32, expert ids [T, top_k] int64); grouped
        top-k, correction bias and scaling factor as `portside.ops.moe.select_experts`."""
        return moe.select_experts(
            router_logits, top_k, renormalize, scoring, num_groups=num_groups, topk_groups=topk_groups,
            group_scoring=group_scoring, correction_bias=correction_bias, scaling_factor=scaling_factor,
        )  # fmt: skip

    def moe_experts(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: str = "silu",
        *,
        w13_bias: torch.Tensor | None = None,
        w2_bias: torch.Tensor | None = None,
        swiglu_alpha: float = moe.SWIGLU_OAI_ALPHA,
        swiglu_limit: float = 7.0,
    ) -> torch.Tensor:
        """x [T, hidden], w13 [E, 2I, hidden], w2 [E, hidden, I] (biases w13_bias [E, 2I], w2_bias
        [E, hidden]) -> [T, hidden] in x's dtype; activation "silu", "gelu_tanh" or "swiglu_oai"."""
        return moe.moe_experts(
            x, w13, w2, topk_weights, topk_ids, activation, w13_bias=w13_bias, w2_bias=w2_bias,
            swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit,
        )  # fmt: skip

    def fused_moe(
        self,
        x: torch.Tensor,
        router_logits: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        top_k: int,
        renormalize: bool,
        scoring: str = "softmax",
        activation: str = "silu",
        *,
        num_groups: int = 1,
        topk_groups: int | None = None,
        group_scoring: str = "max",
        correction_bias: torch.Tensor | None = None,
        scaling_factor: float = 1.0,
        w13_bias: torch.Tensor | None = None,
        w2_bias: torch.Tensor | None = None,
        swiglu_alpha: float = moe.SWIGLU_OAI_ALPHA,
        swiglu_limit: float = 7.0,
    ) -> torch.Tensor:
        """A mixture-of-experts layer: `select_experts` (with the routing options), then
        `moe_experts` (with the expert options)."""
        weights, ids = self.select_experts(
            router_logits, top_k, renormalize, scoring, num_groups=num_groups, topk_groups=topk_groups,
            group_scoring=group_scoring, correction_bias=correction_bias, scaling_factor=scaling_factor,
        )  # fmt: skip
        return self.moe_experts(
            x, w13, w2, weights, ids, activation, w13_bias=w13_bias, w2_bias=w2_bias, swiglu_alpha=swiglu_alpha,
            swiglu_limit=swiglu_limit,
        )  # fmt: skip

    # ---- quantized weights (`portside.quant`: canonical layouts in `portside.quant.weight`) ---

    def prepare_quantized(self, weight: QuantWeight) -> QuantWeight:
        """Called once per quantized layer after loading: re-lay `weight` the way this
        platform's kernels read it (register further buffers on it, set ``weight.layout``), or
        return another `QuantWeight`. The canonical buffers should stay valid: the reference
        (and a kernel declining an input) reads them. Default: as loaded."""
        return weight

    def quantized_linear(self, x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, K] -> [T, N] in x's dtype: x @ dequantize(weight)^T + bias, activations first
        rounded per token where ``weight.act`` says (W8A8). Default: dequantize, then matmul."""
        return quant_weight.quantized_linear(x, weight, bias)

    def quantized_embedding(self, ids: torch.Tensor, weight: QuantWeight) -> torch.Tensor:
        """Rows `ids` [T] of a quantized embedding table -> fp32 [T, hidden] (GGUF embeddings)."""
        return quant_weight.quantized_embedding(ids, weight)

    def quantized_moe_experts(
        self,
        x: torch.Tensor,
        w13: QuantWeight,
        w2: QuantWeight,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: str = "silu",
        *,
        w13_bias: torch.Tensor | None = None,
        w2_bias: torch.Tensor | None = None,
        swiglu_alpha: float = moe.SWIGLU_OAI_ALPHA,
        swiglu_limit: float = 7.0,
    ) -> torch.Tensor:
        """`moe_experts` with stacked quantized experts (w13 [E, 2I, hidden], w2 [E, hidden, I]
        as `QuantWeight`s; w13 a `QuantParts` [gate, up] where their act orders differ), with the
        same options. Default: each expert routed to through `quantized_linear`."""
        return moe.moe_experts(
            x, w13, w2, topk_weights, topk_ids, activation, linear=self._expert_parts_linear, w13_bias=w13_bias,
            w2_bias=w2_bias, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit,
        )  # fmt: skip

    def _expert_parts_linear(self, x: torch.Tensor, w: Any, e: int) -> torch.Tensor:
        if isinstance(w, torch.nn.ModuleList):  # `QuantParts`: each part's expert e, concatenated
            parts: list[Any] = list(w)
            return torch.cat([self._expert_linear(x, part, e) for part in parts], dim=-1)
        return self._expert_linear(x, w, e)

    def _expert_linear(self, x: torch.Tensor, w: QuantWeight, e: int) -> torch.Tensor:
        return self.quantized_linear(x, w.expert(e))

    # ---- batched multi-LoRA (`portside.ops.lora`) -------------------------------------------

    def lora_shrink(self, x: torch.Tensor, a: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
        """x [T, in], a [S, R, in] -> y [T, R] in x's dtype: y[t] = x[t] @ a[slot[t]].T (fp32
        accumulation); 0 for tokens without an adapter."""
        return lora.lora_shrink(x, a, mapping)

    def lora_expand(
        self, y: torch.Tensor, b: torch.Tensor, mapping: LoRAMapping, out: torch.Tensor, out_offset: int = 0
    ) -> None:
        """In place: out[t, out_offset : out_offset + N] += y[t] @ b[slot[t]].T for tokens with an
        adapter; y [T, R] (possibly a column slice of a wider tensor), b [S, N, R], out [T, M]."""
        lora.lora_expand(y, b, mapping, out, out_offset)


_EXPERT_OPTIONS = ("w13_bias", "w2_bias", "swiglu_alpha", "swiglu_limit")
MOE_OPTIONS: dict[str, tuple[str, ...]] = {
    "select_experts": ("num_groups", "topk_groups", "group_scoring", "correction_bias", "scaling_factor"),
    "moe_experts": _EXPERT_OPTIONS,
    "quantized_moe_experts": _EXPERT_OPTIONS,
    "fused_moe": ("num_groups", "topk_groups", "group_scoring", "correction_bias", "scaling_factor", *_EXPERT_OPTIONS),
}
"""The keyword-only options each mixture-of-experts method gained after its first signature
(an override without them is wrapped by `ModelOps.__init_subclass__`)."""


def _option_used(value: Any, default: Any) -> bool:
    """Whether an option's `value` asks for something its `default` does not (a tensor option's
    default is None)."""
    return value is not None if default is None else value != default


def _fall_back_on_new_options(name: str, method: Any, missing: tuple[str, ...]) -> Any:
    """`method` (an override lacking the options `missing`), called as written unless the call
    uses one of them (or the "swiglu_oai" activation, which needs them): then the reference."""
    reference = getattr(ModelOps, name)
    defaults = {k: inspect.signature(reference).parameters[k].default for k in missing}
    sig = inspect.signature(method)

    @functools.wraps(method)
    def call(self: ModelOps, *args: Any, **kwargs: Any) -> Any:
        new = {k: kwargs.pop(k) for k in missing if k in kwargs}
        bound = sig.bind_partial(self, *args, **kwargs).arguments if "activation" in sig.parameters else {}
        activation = bound.get("activation")
        if any(_option_used(v, defaults[k]) for k, v in new.items()) or activation in moe.CLAMPED_ACTIVATIONS:
            return reference(self, *args, **kwargs, **new)
        return method(self, *args, **kwargs)

    call._moe_options_wrapped = True  # type: ignore[attr-defined]
    return call
