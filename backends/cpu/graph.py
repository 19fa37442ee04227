"""cpu graph runners, chosen by the ``cpu_graph`` backend option (``--backend-option cpu_graph=MODE``,
`CpuOptions.graph`):

- ``eager``: the model runs op by op, its linears in faster kernels than torch's default
  (`EagerGraphRunner`, `eager_linears`);
- ``inductor``: ``torch.compile`` (Inductor) over the whole model, paged attention an opaque
  custom op in the graph (`InductorGraphRunner`);
- ``openvino``: the dense segments between attention calls as compiled OpenVINO models,
  attention eager between them (`openvino_runner.OpenVinoGraphRunner`).
"""

from __future__ import annotations

import contextlib
import logging
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from portside.backends.cpu import attention_op, native_ops
from portside.backends.cpu.eager_linears import AMX_MAX_ROWS, EagerLinears, amx_linears, make_packed_weights
from portside.backends.cpu.fused_decode import FusedDecoder, make_fused_decoder
from portside.backends.cpu.openvino_runner import OpenVinoGraphRunner
from portside.backends.cpu.options import GRAPH_MODES, cpu_options  # noqa: F401  (GRAPH_MODES: tests)
from portside.contract import EagerGraphRunner as _CoreEagerGraphRunner
from portside.contract import ForwardContext, GraphRunner, ModelFn, PiecewiseModel

logger = logging.getLogger(__name__)

# Token counts run once in `capture`: one call for each of `_compile`'s two compiled functions
# (a symbolic token count for every size >= 2, and a static graph for one token: batch-1 decode).
WARMUP_TOKENS = (2, 1)


def _own_code(fn: Callable[..., Any], name: str) -> types.FunctionType:
    """`fn` with a code object of its own, named `name`. Dynamo keeps its compiled graphs, and
    its recompile limit, per code object: two runners (engines) in one process, or the body and
    the LM head, must not share one cache."""
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def _no_guards(guard_entries: Sequence[Any]) -> list[bool]:
    """A dynamo `guard_filter_fn` that keeps none of the guards it is offered."""
    return [False] * len(guard_entries)


def _compile(fn: Callable[..., Any], name: str, fn_one: Callable[..., Any] | None = None,
             few_rows: int = 0) -> Callable[..., Any]:
    """torch.compile `fn` twice, under code objects of its own: once for one row (static shapes:
    batch-1 decode; `fn_one` instead when given) and once for two or more rows (the token axis,
    dim 0 of every input, marked dynamic), each called only with its kind of input; with
    `few_rows`, a third time for 2..`few_rows` rows (the axis marked dynamic within that range,
    which the graph pass reads: `GemvAsReduction` puts bf16 linears there in the AMX kernel).

    So each has exactly one graph, and all drop dynamo's filterable guards (`_no_guards`: what
    recent torch calls `torch.compiler.skip_all_guards_unsafe`; torch 2.8 has the filter hook but
    not that function): those re-check, every call, the ~3000 module attributes the graph was
    built from (0.18 ms a call for the default model even through dict version tags, twice a
    step with the LM head; ~1 us is left, the inputs' own checks), and nothing in a running
    engine changes them: the weights are constants (Inductor's freezing), the inputs' dtypes and
    ranks are fixed by the runner, and the row count picks the graph here. (Inputs of the first
    call that alias one another would be compiled in, no longer checked: see `_step_inputs`.)"""

    def own(f: Callable[..., Any], suffix: str) -> Callable[..., Any]:
        if isinstance(f, types.MethodType):
            return types.MethodType(_own_code(f.__func__, name + suffix), f.__self__)
        return _own_code(f, name + suffix)

    options = {"guard_filter_fn": _no_guards}
    compiled_one = torch.compile(own(fn_one or fn, "_1"), options=options)
    compiled_many = torch.compile(own(fn, "_n"), options=options)
    compiled_few = torch.compile(own(fn, "_f"), options=options) if few_rows > 1 else None

    def run(*args: torch.Tensor) -> Any:
        rows = args[0].shape[0]
        if rows == 1:
            return compiled_one(*args)
        if compiled_few is not None and rows <= few_rows:
            for a in args:
                torch._dynamo.mark_dynamic(a, 0, min=2, max=few_rows)
            return compiled_few(*args)
        for a in args:
            torch._dynamo.mark_dynamic(a, 0)
        return compiled_many(*args)

    return run


class _FusedDecodeSteps:
    """The part of a runner that sends one-sequence decode steps to the fused native step
    (`fused_decode`, when it covers the model and the step) and hands the logits a step computed
    itself (there, or in the one-row graph) to `logits`."""

    _fused: FusedDecoder | None = None
    _step_logits: torch.Tensor | None = None
    _rows_step = False  # the last step ran in the fused multi-row step
    _native_pending = False  # the native library is being built in the background (`_take_native`)

    def _take_native(self) -> None:
        """At a step's start while the native library is built in the background: once it is
        loaded (`native_ops.ready`), this step and the later ones take the runner's native paths
        (`_on_native`). Nothing a step keeps depends on which kernels ran the steps before: the
        KV cache layout is the same, and the weights are the model's (the fused step reads them
        in place)."""
        if native_ops.ready():
            self._native_pending = False
            self._on_native()

    def _on_native(self) -> None:
        self._fused = make_fused_decoder(self.model_fn, self.config)  # type: ignore[attr-defined]

    def _fused_step(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor | None:
        """The step's hidden states when a fused step ran it (a one-row step's logits kept), else None.
        Every step starts here: it first takes the native paths if they became ready."""
        if self._native_pending:
            self._take_native()
        self._step_logits, self._rows_step = None, False
        if self._fused is None or ctx.inputs_embeds is not None:
            return None  # embeddings given (image rows, a later pipeline stage): op by op
        if self._fused.covers(input_ids, ctx):
            hidden, self._step_logits = self._fused(input_ids, positions, ctx)
            return hidden
        if self._fused.covers_rows(input_ids, ctx):
            self._rows_step = True
            return self._fused.rows(input_ids, positions, ctx)
        return None

    def logits(self, hidden: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        step_logits, self._step_logits = self._step_logits, None
        rows_step, self._rows_step = self._rows_step, False
        if step_logits is not None:  # a one-row step: the row sampled is that row
            return step_logits
        if rows_step:  # the multi-row step's LM head, natively, for the rows sampled
            return self._fused.logits(hidden[indices])  # type: ignore[union-attr]
        return self.compute_logits(hidden[indices])  # type: ignore[attr-defined]


class _Body(nn.Module):
    """The embedding (with the rotary angles), every decoder layer and the final norm, attention
    through an opaque custom op (`portside_cpu::attention` of `attention_op`, or its C++ front
    `portside_cpu_native::attention` of `native_ops`, given the layer's attention features): one
    graph for the whole model, from the token ids and positions. Under tensor parallelism the
    collectives trace as opaque operators too (`portside.distributed.collectives`). With `logits`
    it returns the LM head's logits of every row too."""

    def __init__(self, model: PiecewiseModel, attention: Callable[..., torch.Tensor], logits: bool = False) -> None:
        super().__init__()
        self.model = model
        self.attention = attention
        self.logits = logits
        self.features = [attention_op.feature_args(model.attention_features(i)) for i in range(model.num_layers)]
        self.sinks = [attention_op.sinks_arg(model.attention_features(i)) for i in range(model.num_layers)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        m = self.model
        h, aux = m.embed(input_ids, positions)
        for i in range(m.num_layers):
            q, k, v = m.pre_attention(i, h, aux)
            if self.sinks[i] is None:
                o = self.attention(q, k, v, i, m.attention_scale(i), *self.features[i])
            else:  # a layer with attention sinks (gpt-oss): the Python operator that takes them
                o = torch.ops.portside_cpu.attention_sinks(q, k, v, i, m.attention_scale(i), *self.features[i],
                                                           self.sinks[i])  # fmt: skip
            h = m.post_attention(i, h, o)
        h = m.final_norm(h)
        return (h, m.compute_logits(h)) if self.logits else h  # type: ignore[attr-defined]


class InductorGraphRunner(_FusedDecodeSteps, GraphRunner):
    """torch.compile (Inductor) over the whole model (`_Body`), with paged attention an opaque
    custom op inside the graph (`attention_op`) that runs the step's attention backend eagerly,
    or, in decode-only steps, the native kernels with no Python at all (`native_ops`). Host-side
    attention metadata never reaches dynamo, so nothing guards on it: after `capture` compiles the two graphs
    (1 token, and a symbolic count >= 2) for the body and for the LM head, no step recompiles. A
    batch-1 step is one call into compiled code (its graph computes the LM head too), a larger
    one two (the body, then the LM head of the sampled rows). A bf16 model on a CPU with AMX
    (`cpu_bf16_linears` amx) gets a third body graph, for 2..`AMX_MAX_ROWS` rows (batched decode
    steps), whose linears run in the AMX tile kernel (`GemvAsReduction`); the symbolic graph then
    takes the larger counts (prefill) in oneDNN.

    One-sequence decode steps of a Llama-family fp32 model run in the fused native step instead
    (`fused_decode`), so the one-row body graph is compiled only where that does not apply.

    A model that is not a `PiecewiseModel` runs eagerly (with a warning): compiling a whole
    step with its Python attention traced in recompiles on nearly every step."""

    name = "inductor"

    def __init__(self, model_fn: ModelFn, config: Any) -> None:
        super().__init__(model_fn, config)
        self.model: PiecewiseModel | None = None
        self._logits: Callable[..., torch.Tensor] | None = None
        self._few_rows = 0
        if not isinstance(model_fn, PiecewiseModel):
            logger.warning(
                "cpu graph mode 'inductor': %s is not a PiecewiseModel; running it eagerly", type(model_fn).__name__
            )
            return
        self._forward_context = attention_op.forward_context
        self.model = model_fn
        self._fused = make_fused_decoder(model_fn, config)
        # Decode-only steps attend in C++ with no call back into Python when the native
        # operators build here (~12 us a layer warm, more right after the weight stream).
        self._native = native_ops.ready()  # (built in the background: the graphs keep torch's kernels, `_on_native`)
        self._native_pending = not self._native and native_ops.pending()
        attention = torch.ops.portside_cpu_native.attention if self._native else torch.ops.portside_cpu.attention
        # One-row steps (batch-1 decode) get the LM head in the same graph: one compiled call a
        # step instead of two, each with its Python entry and exit, and no gather between them.
        # (A one-row step that samples nothing, a one-token prefill chunk before the last,
        # computes logits it does not use: rare, and cheaper than a second graph call when used.)
        one_row = _Body(model_fn, attention, logits=True).forward
        # bf16 on AMX: graphs of their own for 2..AMX_MAX_ROWS rows (batched decode), their
        # linears in the AMX tile kernel (`eager_linears`, option cpu_bf16_linears)
        self._few_rows = AMX_MAX_ROWS if self._native and amx_linears(config) else 0
        self._body = _compile(_Body(model_fn, attention).forward, "portside_body", one_row, self._few_rows)
        # (not the LM head: at 64 rows x 49152 x 576 oneDNN's kernel beats the AMX one, 1.65 against 2.22 ms)
        self._logits = _compile(model_fn.compute_logits, "portside_logits")  # type: ignore[attr-defined]
        if self._few_rows:
            logger.info("inductor: bf16 linears of 2..%d rows in the AMX tile kernel", self._few_rows)

    def capture(self, make_dummy_context: Callable[[int], ForwardContext]) -> None:
        """Compile the graphs now, on dummy decode batches, not in the first steps (the one-row
        body graph only if the fused step does not cover a one-row decode: `__call__`)."""
        if self.model is None:
            return
        t0 = time.perf_counter()
        # Freezing treats the weights as constants and prepacks them for oneDNN's linear kernels
        # (default model, 32 x 64 -> 64 tokens: 123 tok/s frozen vs 102 unfrozen vs 97 eager).
        # The graphs are built here, so the setting is scoped to this warm-up. A packed copy of
        # the weights is kept for the multi-row graph: the dense weights take about twice their
        # size. One-row graphs read each weight with the native one-row operator instead of a
        # GEMV (`GemvAsReduction`). `cpp_wrapper`: the code that calls the ~10 kernels of every layer
        # is C++, not Python (default model, 2 threads: batch-1 decode 21 -> 16 ms/token, a
        # 64-sequence decode step 141 -> 134 ms).
        from portside.backends.cpu.gemv_pass import GemvAsReduction  # imports Inductor (~1 s)

        options = {"freezing": True, "pre_grad_custom_pass": GemvAsReduction(amx_rows=self._few_rows), "cpp_wrapper": True}
        with torch._inductor.config.patch(options):
            for n in WARMUP_TOKENS + ((self._few_rows + 1,) if self._few_rows else ()):
                ctx = make_dummy_context(n)
                hidden = self(*_step_inputs(n, ctx.metadata.slot_mapping.device), ctx)
                self.compute_logits(hidden)
        logger.info("inductor: compiled the model in %.1f s", time.perf_counter() - t0)

    def _on_native(self) -> None:
        """The fused decode steps and the attention backend's native kernels (called from the
        graphs through `portside_cpu::attention`); the compiled graphs keep torch's one-row
        linears until the next start (recompiling them would stall a step for seconds)."""
        if self.model is not None:
            super()._on_native()

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        hidden = self._fused_step(input_ids, positions, ctx)
        if hidden is not None:
            return hidden
        if self.model is None:
            return self.model_fn(input_ids, positions, ctx)
        with self._forward_context(ctx, self._native):
            out = self._body(input_ids, positions)
        if isinstance(out, tuple):  # the one-row graph: hidden and logits
            out, self._step_logits = out
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._logits is None:
            return super().compute_logits(hidden)
        return self._logits(hidden)


def _step_inputs(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Dummy token ids and positions made like the runner's: two tensors (one passed twice would
    compile a graph with a single input, and with no guards, `_compile`, it would then read the
    ids as positions) and normal ones, not inference tensors (the runner makes its inputs outside
    inference mode; a graph compiled for the other kind would be compiled again)."""
    with torch.inference_mode(False):
        return torch.zeros(n, dtype=torch.long, device=device), torch.zeros(n, dtype=torch.long, device=device)


def make_graph_runner(model_fn: ModelFn, config) -> GraphRunner:
    """The runner `CpuOptions.graph` names (option cpu_graph); the eager one for a hybrid model
    (layers with a recurrent state), which the compiled runners do not trace."""
    runner = {"inductor": InductorGraphRunner, "openvino": OpenVinoGraphRunner, "eager": EagerGraphRunner}
    cls = runner[cpu_options(config).graph]
    spec_fn = getattr(model_fn, "state_spec", None)
    if not cls.supports_recurrent_state and spec_fn is not None and spec_fn() is not None:
        logger.info("cpu_graph=%s: this model's layers keep a recurrent state, which the %s runner does not trace; "
                    "it runs in the eager runner", cpu_options(config).graph, cls.name)
        cls = EagerGraphRunner
    return cls(model_fn, config)


class EagerGraphRunner(_FusedDecodeSteps, _CoreEagerGraphRunner):
    """Op by op, as core's eager runner, but its linears in faster kernels (`eager_linears`): one
    fp32 or bf16 row (batch-1 decode, a single sequence's LM head) in the native operator
    (`native_ops`) rather than torch's GEMV, several rows in oneDNN's linear over prepacked weights
    rather than MKL's sgemm (option ``cpu_prepack``; bf16 on CPUs without bf16 arithmetic over fp32
    copies, option ``cpu_bf16_linears``). One-sequence decode steps of a Llama-family fp32 or bf16
    model run in the fused native step (`fused_decode`). Without a C++ compiler or oneDNN, the linears
    concerned stay with torch's kernels; while the native library is built in the background, until
    the first step after it is built (`_take_native`)."""

    supports_pipeline_stages = True  # op by op: a stage's `embed` reads its input when called
    supports_recurrent_state = True  # op by op (the fused decode step takes Llama-family models only)

    def __init__(self, model_fn: ModelFn, config) -> None:
        super().__init__(model_fn, config)
        reason = native_ops.not_ready_reason()
        self._native_pending = reason is not None and native_ops.pending()
        if self._native_pending:
            logger.info("cpu eager: torch's kernels until the native library is built in the background")
        elif reason:
            logger.warning("cpu eager: one-row linears use torch's GEMV (native operator unavailable: %s)", reason)
        self._native = reason is None
        self._fused = make_fused_decoder(model_fn, config) if self._native else None
        self.packed_weights = make_packed_weights(config)
        self._amx = amx_linears(config)

    def capture(self, make_dummy_context: Callable[[int], ForwardContext]) -> None:
        """Packs the weights of the multi-row linears now, with one dummy two-row step through
        the model and the LM head: their memory is taken at start-up, not in the first request."""
        if self.packed_weights is None:
            return
        t0 = time.perf_counter()
        ctx = make_dummy_context(2)
        self.packed_weights.recording = True  # the kinds of linear calls the model makes
        hidden = self(*_step_inputs(2, ctx.metadata.slot_mapping.device), ctx)
        stage = getattr(self.model_fn, "stage", None)
        # an earlier pipeline stage has no LM head, nor has an encoder-only model (it pools)
        if (stage is None or stage.is_last) and not getattr(self.model_fn, "is_encoder_only", False):
            self.compute_logits(hidden)
        self.packed_weights.recording = False
        sched = self.config.scheduler
        with torch.inference_mode():
            calls = self.packed_weights.warm(max(sched.max_num_batched_tokens, sched.max_num_seqs))
        logger.info("cpu eager: %d weights prepacked for oneDNN, %d row-count shapes built, in %.2f s",
                    len(self.packed_weights), calls, time.perf_counter() - t0)

    def _mode(self, rows: int, amx: bool = True) -> contextlib.AbstractContextManager[Any]:
        # Only around steps it can speed up: the mode's Python hook on every torch call costs
        # a few percent of a step. (`amx`: False for the LM head, where oneDNN is faster.)
        amx = amx and self._amx
        if (rows == 1 and self._native) or (rows > 1 and (self.packed_weights is not None or amx)):
            return EagerLinears(self._native, self.packed_weights, amx)
        return contextlib.nullcontext()

    def _on_native(self) -> None:
        """The one-row and AMX linears, and the fused decode steps."""
        self._native = True
        self._amx = amx_linears(self.config)
        super()._on_native()

    def eager_mode(self, rows: int) -> contextlib.AbstractContextManager[Any]:
        return self._mode(rows)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        hidden = self._fused_step(input_ids, positions, ctx)
        if hidden is not None:
            return hidden
        with self._mode(input_ids.shape[0]):
            return self.model_fn(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with self._mode(hidden.shape[0], amx=False):
            return super().compute_logits(hidden)
