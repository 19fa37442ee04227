"""OpenVINO graph runner: the dense parts of the model as OpenVINO models, attention in torch.

The predictable path (`openvino.convert_model` + `compile_model("CPU")`), not
`torch.compile(backend="openvino")`, whose dynamo backend silently falls back to Inductor on any
conversion error. The model, through core's `PiecewiseModel` seam, is cut at its attention
calls into ``num_layers + 1`` segments:

    head:  h, *aux                -> h, q, k, v       (layer 0 up to attention)
    mid i: h, o, *aux             -> h, q, k, v       (layer i-1 after attention, layer i up to it)
    tail:  h, o                   -> hidden           (last layer after attention, final norm)

`aux` is what every layer shares (the rotary cos/sin). Each segment is converted once with a
dynamic token axis, so any batch shape runs without recompiling. Paged attention (which writes
the KV cache in place) stays in the platform's attention backend between segments. Tensor
parallel size 1 only (the all-reduces inside a segment would need OpenVINO collectives).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import nn

from portside.backend_api import ForwardContext, GraphRunner, ModelFn, PiecewiseModel

logger = logging.getLogger(__name__)


def openvino_available() -> str | None:
    """None if `openvino` imports, else the reason."""
    try:
        import openvino  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the environment
        return f"openvino is not importable ({e}); pip install 'portside[openvino]'"
    return None


class _Head(nn.Module):
    """Layer 0 up to its attention: h, *aux -> h, q, k, v."""

    def __init__(self, model: PiecewiseModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, h, *aux):
        return (h, *self.model.pre_attention(0, h, aux))


class _Mid(nn.Module):
    """From layer i-1's attention output to layer i's attention: h, o, *aux -> h, q, k, v."""

    def __init__(self, model: PiecewiseModel, i: int) -> None:
        super().__init__()
        self.model, self.i = model, i

    def forward(self, h, o, *aux):
        h = self.model.post_attention(self.i - 1, h, o)
        return (h, *self.model.pre_attention(self.i, h, aux))


class _Tail(nn.Module):
    """The last layer after its attention, and the final norm: h, o -> hidden."""

    def __init__(self, model: PiecewiseModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, h, o):
        return self.model.final_norm(self.model.post_attention(self.model.num_layers - 1, h, o))


class OpenVinoGraphRunner(GraphRunner):
    """Runs each step through `num_layers + 1` compiled OpenVINO models (see the module doc).

    `num_ov_calls` counts OpenVINO inferences: tests use it to prove OpenVINO actually ran.
    """

    name = "openvino"

    def __init__(self, model_fn: ModelFn, config: Any) -> None:
        super().__init__(model_fn, config)
        reason = openvino_available()
        if reason:
            raise RuntimeError(reason)
        if not isinstance(model_fn, PiecewiseModel):
            raise ValueError("cpu graph mode 'openvino' needs a model that implements portside.backend_api.PiecewiseModel")
        self.model: PiecewiseModel = model_fn
        self.num_ov_calls = 0
        self._requests: list[Any] = []
        self._compiled: list[Any] = []
        self._build()

    def _build(self) -> None:
        import openvino as ov

        model = self.model
        t0 = time.perf_counter()
        with torch.no_grad():  # example inputs of 3 tokens; the token axis is dynamic
            ids, pos = torch.zeros(3, dtype=torch.long), torch.arange(3)
            ex_h, ex_aux = model.embed(ids, pos)
            ex_o = model.pre_attention(0, ex_h, ex_aux)[0]  # attention output has the query's shape
        dynamic = lambda t: ov.PartialShape([-1, *t.shape[1:]])  # noqa: E731
        head = ((ex_h, *ex_aux), [dynamic(t) for t in (ex_h, *ex_aux)])
        mid = ((ex_h, ex_o, *ex_aux), [dynamic(t) for t in (ex_h, ex_o, *ex_aux)])
        tail = ((ex_h, ex_o), [dynamic(ex_h), dynamic(ex_o)])
        segments = [(_Head(model), *head)]
        segments += [(_Mid(model, i), *mid) for i in range(1, model.num_layers)]
        segments.append((_Tail(model), *tail))
        core = ov.Core()
        props = {
            "INFERENCE_NUM_THREADS": torch.get_num_threads(),
            "NUM_STREAMS": 1,
            "PERFORMANCE_HINT": "LATENCY",
        }
        if ex_h.dtype == torch.float32:
            props["INFERENCE_PRECISION_HINT"] = "f32"  # no silent bf16 on AMX/AVX-512-BF16 CPUs
        with torch.no_grad():
            for module, example, shapes in segments:
                ov_model = ov.convert_model(module.eval(), example_input=example, input=shapes)
                compiled = core.compile_model(ov_model, "CPU", props)
                self._compiled.append(compiled)
                self._requests.append(compiled.create_infer_request())
        logger.info("openvino: compiled %d segments in %.1f s", len(segments), time.perf_counter() - t0)

    def _infer(self, i: int, *args: torch.Tensor) -> list[torch.Tensor]:
        """Run segment i. Inputs are shared with OpenVINO (no copy); outputs are fresh arrays,
        because the request's own output buffers are reallocated when the token count changes."""
        inputs = [a.contiguous().numpy() for a in args]  # kept alive for the duration of infer
        res = self._requests[i].infer(inputs, share_inputs=False, share_outputs=False)
        self.num_ov_calls += 1
        return [torch.from_numpy(res[out]) for out in self._compiled[i].outputs]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        model = self.model
        h, aux = model.embed(input_ids, positions)  # embedding and rotary stay in torch (gathers)
        h, q, k, v = self._infer(0, h, *aux)
        last = model.num_layers - 1
        for i in range(model.num_layers):
            o = ctx.attention(i, q, k, v, model.attention_scale(i))  # [T, H, D], paged, in torch
            if i < last:
                h, q, k, v = self._infer(i + 1, h, o, *aux)
            else:
                (h,) = self._infer(i + 1, h, o)
        return h
