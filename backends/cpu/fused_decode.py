"""Batch-1 decode of a Llama-family fp32 or bf16 model as one native call: the torch class
`portside_cpu_native.LlamaDecoder` (`csrc/fused_decode.cpp`), used by the eager and inductor cpu
graph runners for every one-sequence decode step (option ``cpu_fused_decode``, on by default).

A batch-1 decode step reads every weight once, one matrix after another, and does little else;
run op by op (or as an Inductor graph calling one operator per matrix), the gaps between the
matrices (dispatcher calls, small kernels, a fork/join each, the compiled call's entry and exit)
cost ~2 ms of a ~12 ms step on the CI machine. The native step runs the whole model in one OpenMP
parallel region instead (see the C++ file).

One sequence's steps of 2..16 rows (a speculative verification: the last token and its k
proposals; a short prefill chunk) run in the native multi-row step (`step_rows`), which streams
each weight once for all rows: op by op (oneDNN's small-M GEMMs, prefill-style attention) a
5-row verification cost ~2.7x a batch-1 step. Steps neither covers (several sequences, longer
prefill chunks, other models, tensor parallelism, other dtypes) run as before.

bf16 models run the batch-1 step too: the bf16 matrices are streamed as they are (half the bytes
of fp32) and each dot product widens them to fp32 as it loads them, with fp32 activations and
accumulation, over the model's bf16 KV cache; their multi-row steps as well.

GGUF-quantized models whose every matrix (q/k/v, o, gate/up, down and the LM head, part by part)
took an int8-activation kernel (backend option ``cpu_gguf_act=int8``: layouts ``gguf-<type>-int8``
of `quant`) run their batch-1 steps natively too (`step_h`): the matrices stay in their GGUF
blocks and each dot product is `gguf_dot`'s, the arithmetic the op-by-op linears compute; the
embedding row is looked up in torch (`quantized_embedding`) and handed in. Their multi-row steps
run op by op. With fp32 activations (the default) GGUF models run op by op.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from portside.backends.cpu import gguf_dot, native_ops
from portside.backends.cpu.attention import MAX_FUSED_ROWS
from portside.backends.cpu.options import cpu_options
from portside.contract import ForwardContext

logger = logging.getLogger(__name__)

FUSED_DTYPES = (torch.float32, torch.bfloat16)  # the model dtypes (and so KV cache dtypes) the native steps take
# What the native step computes exactly: core's Llama-family class (exactly it, not a subclass
# that may change a layer) for the architectures it serves, with no attention feature in any layer.
# LLaVA's language model is one of these (its vision tower runs outside the step: image rows come
# as given embeddings, which the step declines)
FUSED_CLASSES = frozenset({"portside.model.llama.LlamaForCausalLM", "portside.model.llava.LlavaForConditionalGeneration",
                           "portside.model.llava.LlavaNextForConditionalGeneration"})
FUSED_ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                 "LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration"})
# `ModelArgs` fields the step does not compute, with the value that means "not used"
NEUTRAL_ARGS = {"hidden_act": "silu", "num_experts": 0, "partial_rotary_factor": 1.0, "clip_qkv": None,
                "final_logit_softcap": None, "rope_local_theta": None}


class FusedDecoder:
    """The native decoder of one model; `__call__` runs a one-sequence decode step."""

    def __init__(self, model: Any) -> None:
        m, args = model.model, model.config
        attn = m.layers[0].self_attn
        self.quantized = _is_quantized(model)
        self._embed = m.embed_tokens

        def bias(linear: torch.nn.Module) -> torch.Tensor:
            b = getattr(linear, "bias", None)
            return b.detach() if b is not None else torch.empty(0)

        def matrix(linear: torch.nn.Module) -> torch.Tensor:  # quantized: passed by `set_quantized`
            return torch.empty(0) if self.quantized else linear.weight.detach()

        tensors = [matrix(m.embed_tokens), m.norm.weight.detach(), matrix(model.lm_head), m.rotary.cos_sin]
        for layer in m.layers:
            a, mlp = layer.self_attn, layer.mlp
            tensors += [
                layer.input_layernorm.weight.detach(), matrix(a.qkv_proj), bias(a.qkv_proj),
                matrix(a.o_proj), bias(a.o_proj), layer.post_attention_layernorm.weight.detach(),
                matrix(mlp.gate_up_proj), bias(mlp.gate_up_proj), matrix(mlp.down_proj), bias(mlp.down_proj),
            ]
        dims = [len(m.layers), args.hidden_size, args.num_heads, args.num_kv_heads, args.head_dim,
                args.intermediate_size, args.vocab_size, int(self.quantized)]
        self._decoder = torch.classes.portside_cpu_native.LlamaDecoder(tensors, dims, args.rms_norm_eps, attn.scale)
        if self.quantized:
            self._decoder.set_quantized(*_quantized_parts(model))
            self.covers_rows = _covers_no_rows  # type: ignore[method-assign]  # batch-1 steps only
        # fp32 or bf16: the hidden states handed back
        self.dtype = m.norm.weight.dtype if self.quantized else m.embed_tokens.weight.dtype

    @staticmethod
    def covers(input_ids: torch.Tensor, ctx: ForwardContext) -> bool:
        """Whether this step is a one-sequence decode the native step runs: one row, a decode-only
        native attention plan, and fp32 or bf16 caches (not an 8-bit `--kv-cache-dtype`)."""
        return (input_ids.shape[0] == 1 and getattr(ctx.metadata.backend_data, "native_step", None) is not None
                and ctx.kv_caches[0].dtype in (torch.float32, torch.bfloat16))

    @staticmethod
    def covers_rows(input_ids: torch.Tensor, ctx: ForwardContext) -> bool:
        """Whether this step is one sequence's 2..`MAX_FUSED_ROWS` rows (a speculative verification,
        a short prefill chunk) that the native multi-row step runs: the attention backend made
        its one-sequence plan (`NativeAttentionBackend.prepare`), and fp32 or bf16 caches (the
        model's dtype: not an 8-bit `--kv-cache-dtype`). A quantized model's decoder covers none
        (its instance's `covers_rows`)."""
        return (2 <= input_ids.shape[0] <= MAX_FUSED_ROWS
                and getattr(ctx.metadata.backend_data, "native_rows", None) is not None
                and ctx.kv_caches[0].dtype in FUSED_DTYPES)

    def rows(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """hidden [M, hidden] after the final norm, in the model's dtype, of a step `covers_rows`
        accepts (its LM head: `logits`, for the rows sampled); the M new K/V rows are written into
        `ctx.kv_caches`."""
        torch.ops.portside_cpu_native.set_decode_step(ctx.kv_caches, *ctx.metadata.backend_data.native_rows)
        try:
            hidden = self._decoder.step_rows(input_ids, positions)
        finally:
            torch.ops.portside_cpu_native.clear_decode_step()
        return hidden if self.dtype == torch.float32 else hidden.to(self.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [N, vocab] of hidden [N, hidden] (fp32 or bf16): the LM head streamed once for all rows."""
        return self._decoder.logits(hidden.float())

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden [1, hidden] after the final norm, in the model's dtype; fp32 logits [1, vocab])
        of a covered step; the new K/V rows are written into `ctx.kv_caches`."""
        step = ctx.metadata.backend_data.native_step
        h0 = self._embed(input_ids).float().contiguous() if self.quantized else None
        torch.ops.portside_cpu_native.set_decode_step(ctx.kv_caches, *step.tensors)
        try:
            hidden, logits = self._decoder.step(input_ids, positions) if h0 is None else self._decoder.step_h(h0, positions)
        finally:
            torch.ops.portside_cpu_native.clear_decode_step()
        return (hidden if self.dtype == torch.float32 else hidden.to(self.dtype)), logits


def unsupported_reason(model: Any) -> str | None:
    """None when `model` can run in the native decode step, else why not. The model is
    recognised by its class's qualified name (`FUSED_CLASSES`), not imported: a backend depends
    on core's contract only (`portside.model.llama.LlamaForCausalLM` serves Llama, Mistral and
    Qwen2); a subclass, another architecture or a layer with attention features is refused."""
    cls = type(model)
    if f"{cls.__module__}.{cls.__qualname__}" not in FUSED_CLASSES or not hasattr(model, "model"):
        return f"{cls.__module__}.{cls.__qualname__} is not a Llama-family model class the native step computes"
    args = model.config
    stage = getattr(model, "stage", None)
    if stage is not None and stage.num_stages > 1:
        return "a pipeline-parallel stage (its input is the previous stage's hidden states)"
    if args.architecture not in FUSED_ARCHITECTURES:
        return f"architecture {args.architecture!r} is not one of {sorted(FUSED_ARCHITECTURES)}"
    for name, neutral in NEUTRAL_ARGS.items():
        if getattr(args, name, neutral) != neutral:
            return f"{name}={getattr(args, name)!r}"
    for i in range(model.num_layers):
        used = {name: value for name, value in model.attention_features(i).items() if value is not None}
        if used:
            return f"layer {i} uses attention features {used}"
    if _is_quantized(model):
        why = quantized_reason(model)
        if why:
            return why
    if model.dtype not in FUSED_DTYPES:
        return f"dtype {model.dtype} (the native step is fp32 or bf16)"
    if model.model.embed_tokens.tp_size != 1:
        return "tensor parallelism"
    params = [*model.parameters(), model.model.rotary.cos_sin, *(w.qweight for w in _quant_weights(model))]
    if any(p.device.type != "cpu" or not p.is_contiguous() for p in params):
        return "a weight that is not a contiguous cpu tensor"
    return native_ops.not_ready_reason()


def _covers_no_rows(input_ids: torch.Tensor, ctx: ForwardContext) -> bool:
    return False


def _is_quantized(model: Any) -> bool:
    return bool(getattr(model.config, "quantized", False)) or any(getattr(m, "quant", None) is not None
                                                                  for m in model.modules())


def _quant_weights(model: Any) -> list[Any]:
    """The quantized weights of the model's linears, LM head and embedding (parts of a fused one apart)."""
    out = []
    for m in model.modules():
        q = getattr(m, "quant", None)
        if isinstance(q, torch.nn.ModuleList):
            out += list(q)
        elif q is not None:
            out.append(q)
    return out


def _matrices(model: Any) -> list[torch.nn.Module]:
    """The linears the native step multiplies by, in `set_quantized`'s order: per layer qkv, o,
    gate_up, down; then the LM head."""
    out: list[torch.nn.Module] = []
    for layer in model.model.layers:
        a, mlp = layer.self_attn, layer.mlp
        out += [a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj]
    return [*out, model.lm_head]


def _parts(linear: torch.nn.Module) -> list[Any]:
    q = getattr(linear, "quant", None)
    return list(q) if isinstance(q, torch.nn.ModuleList) else [q]


def quantized_reason(model: Any) -> str | None:
    """None when every matrix of a quantized model is GGUF blocks that took an int8-activation
    kernel (``cpu_gguf_act=int8``), so the native step computes them as the op-by-op linears do;
    else why not."""
    for linear in _matrices(model):
        for w in _parts(linear):
            layout = getattr(w, "layout", None)
            kernel = getattr(layout, "kernel", "")
            if (w is None or getattr(w, "kind", None) != "gguf" or w.ggml_type not in gguf_dot.TYPES
                    or not kernel.endswith("-int8") or w.qweight.dim() != 2):
                what = "dense weights" if w is None else f"{w.extra_repr()} (layout {kernel or None})"
                return (f"quantized weights not all GGUF blocks with int8 activations (cpu_gguf_act=int8): "
                        f"{type(linear).__name__} has {what}")
    if len(_parts(model.lm_head)) > 4 or any(len(_parts(m)) > 4 for m in _matrices(model)):
        return "a quantized matrix in more than 4 parts"
    return None


def _quantized_parts(model: Any) -> tuple[list[torch.Tensor], list[int]]:
    """`LlamaDecoder.set_quantized`'s arguments: every part's GGUF rows, and (matrix, type,
    first row, rows) per part."""
    tensors: list[torch.Tensor] = []
    meta: list[int] = []
    for i, linear in enumerate(_matrices(model)):
        row = 0
        for w in _parts(linear):
            tensors.append(w.qweight)
            meta += [i, int(w.ggml_type), row, int(w.qweight.shape[0])]
            row += int(w.qweight.shape[0])
    return tensors, meta


def make_fused_decoder(model: Any, config: Any) -> FusedDecoder | None:
    """The native decoder for `model` when option ``cpu_fused_decode`` is on (the default) and the
    model qualifies; None otherwise (logged)."""
    if not cpu_options(config).fused_decode:
        return None
    reason = unsupported_reason(model)
    if reason:
        logger.info("cpu: batch-1 decode runs op by op, not in the fused native step: %s", reason)
        return None
    logger.info("cpu: batch-1 decode steps run in the fused native step (csrc/fused_decode.cpp), %s%s",
                str(model.dtype).removeprefix("torch."),
                " model, GGUF matrices x int8 activations" if _is_quantized(model)
                else "" if model.dtype == torch.float32 else " weights and KV cache, fp32 activations and sums")
    return FusedDecoder(model)
