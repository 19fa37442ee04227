"""cpu graph runners, chosen by the ``cpu_graph`` platform option (``--cpu-graph``):

- ``eager``: the model runs op by op, one-row fp32 linears through the native operator
  (`EagerGraphRunner`);
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
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from portside.backend_api import EagerGraphRunner as _CoreEagerGraphRunner
from portside.backend_api import ForwardContext, GraphRunner, ModelFn, PiecewiseModel

logger = logging.getLogger(__name__)

GRAPH_MODES = ("eager", "inductor", "openvino")
DEFAULT_GRAPH_MODE = "eager"

# Token counts run once in `capture`: dynamo specializes a size of 1 (its own static graph,
# batch-1 decode) and compiles one graph with a symbolic token count for every size >= 2.
WARMUP_TOKENS = (2, 1)


def _own_code(fn: Callable[..., Any], name: str) -> types.FunctionType:
    """`fn` with a code object of its own, named `name`. Dynamo keeps its compiled graphs, and
    its recompile limit, per code object: two runners (engines) in one process, or the body and
    the LM head, must not share one cache."""
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def _compile(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """torch.compile `fn` under its own code object; the token axis (dim 0) of every input is
    marked dynamic at two or more rows, so one graph serves every count >= 2 and a single row
    (specialised by dynamo anyway) gets its own graph."""
    if isinstance(fn, types.MethodType):
        fn = types.MethodType(_own_code(fn.__func__, name), fn.__self__)
    compiled = torch.compile(fn)

    def run(*args: torch.Tensor) -> Any:
        if args[0].shape[0] > 1:
            for a in args:
                torch._dynamo.mark_dynamic(a, 0)
        return compiled(*args)

    return run


class _Body(nn.Module):
    """Every decoder layer and the final norm, attention through the opaque custom op
    (`attention_op`): h, *aux -> hidden, one graph for the whole model."""

    def __init__(self, model: PiecewiseModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, h: torch.Tensor, *aux: torch.Tensor) -> torch.Tensor:
        m = self.model
        for i in range(m.num_layers):
            q, k, v = m.pre_attention(i, h, aux)
            o = torch.ops.portside_cpu.attention(q, k, v, i, m.attention_scale(i))
            h = m.post_attention(i, h, o)
        return m.final_norm(h)


class InductorGraphRunner(GraphRunner):
    """torch.compile (Inductor) over the whole model but its embedding (`_Body`), with paged
    attention an opaque custom op inside the graph (`attention_op`) that runs the step's attention
    backend eagerly. Host-side attention metadata never reaches dynamo, so nothing guards on it:
    after `capture` compiles the two graphs (1 token, and a symbolic count >= 2) for the body and
    for the LM head, no step recompiles, and a step is one call into compiled code (plus the LM
    head's) instead of one per layer.

    A model that is not a `PiecewiseModel` runs eagerly (with a warning): compiling a whole
    step with its Python attention traced in recompiles on nearly every step."""

    name = "inductor"

    def __init__(self, model_fn: ModelFn, config: Any) -> None:
        super().__init__(model_fn, config)
        self.model: PiecewiseModel | None = None
        self._logits: Callable[..., torch.Tensor] | None = None
        if not isinstance(model_fn, PiecewiseModel):
            logger.warning(
                "cpu graph mode 'inductor': %s is not a PiecewiseModel; running it eagerly", type(model_fn).__name__
            )
            return
        from portside.backends.cpu import attention_op  # registers portside_cpu::attention

        self._forward_context = attention_op.forward_context
        self.model = model_fn
        self._body = _compile(_Body(model_fn).forward, "portside_body")
        # The LM head too (its all-gather under tensor parallelism stays eager).
        if config.parallel.tensor_parallel_size == 1:
            self._logits = _compile(model_fn.compute_logits, "portside_logits")  # type: ignore[attr-defined]

    def capture(self, make_dummy_context: Callable[[int], ForwardContext]) -> None:
        """Compile the graphs now, on dummy decode batches, not in the first steps."""
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

        options = {"freezing": True, "pre_grad_custom_pass": GemvAsReduction(), "cpp_wrapper": True}
        # Guards on the model's ~3000 module attributes are checked through the dicts' version
        # tags, module by module, instead of one by one: a step's two guard checks take ~0.18 ms
        # instead of ~0.44 ms each (default model). Still exact: a changed module fails its tag.
        guards = {"use_recursive_dict_tags_for_guards": True, "max_saved_pointers_for_recursive_dict_tags_check": 1 << 16}
        with torch._inductor.config.patch(options), torch._dynamo.config.patch(guards):
            for n in WARMUP_TOKENS:
                ctx = make_dummy_context(n)
                zeros = torch.zeros(n, dtype=torch.long, device=ctx.metadata.slot_mapping.device)
                hidden = self(zeros, zeros, ctx)
                self.compute_logits(hidden)
        logger.info("inductor: compiled the model in %.1f s", time.perf_counter() - t0)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if self.model is None:
            return self.model_fn(input_ids, positions, ctx)
        h, aux = self.model.embed(input_ids, positions)  # embedding and rotary gathers stay eager
        with self._forward_context(ctx):
            return self._body(h, *aux)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._logits is None:
            return super().compute_logits(hidden)
        return self._logits(hidden)


def make_graph_runner(model_fn: ModelFn, config) -> GraphRunner:
    mode = config.option("cpu_graph", DEFAULT_GRAPH_MODE)
    if mode == "inductor":
        return InductorGraphRunner(model_fn, config)
    if mode == "openvino":
        from portside.backends.cpu.openvino_runner import OpenVinoGraphRunner

        return OpenVinoGraphRunner(model_fn, config)
    return EagerGraphRunner(model_fn, config)


class _OneRowLinears(torch.overrides.TorchFunctionMode):
    """Sends `F.linear` of one fp32 row to `portside_cpu_native::linear_row`, everything else on."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is F.linear:
            x = args[0] if args else kwargs["input"]
            if x.dim() == 2 and x.shape[0] == 1 and x.dtype == torch.float32:
                weight = args[1] if len(args) > 1 else kwargs["weight"]
                bias = args[2] if len(args) > 2 else kwargs.get("bias")
                return torch.ops.portside_cpu_native.linear_row(x, weight, bias)
        return func(*args, **kwargs)


class EagerGraphRunner(_CoreEagerGraphRunner):
    """Op by op, as core's eager runner, but a one-row fp32 linear (batch-1 decode, a single
    sequence's LM head) runs in the native operator (`linear_op`) rather than MKL's GEMV, which
    streams the weight at ~10 GB/s on a Zen 4 where the operator gets 35-49 (batch-1 decode of the
    default model, 2 threads: see docs/cpu.md). Without a C++ compiler: core's runner, unchanged."""

    def __init__(self, model_fn: ModelFn, config) -> None:
        super().__init__(model_fn, config)
        from portside.backends.cpu import linear_op

        reason = linear_op.unavailable_reason()
        if reason:
            logger.warning("cpu eager: one-row linears use torch's GEMV (native operator unavailable: %s)", reason)
        self._native = reason is None

    def _mode(self, rows: int) -> contextlib.AbstractContextManager[Any]:
        # Only one-row steps: the mode's Python hook on every torch call costs ~6% of a
        # 64-sequence step (default model) where there is no one-row linear to gain on.
        return _OneRowLinears() if self._native and rows == 1 else contextlib.nullcontext()

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        with self._mode(input_ids.shape[0]):
            return self.model_fn(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with self._mode(hidden.shape[0]):
            return super().compute_logits(hidden)
