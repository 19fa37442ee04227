"""OpenVINO graph runner: the dense parts of the model as OpenVINO models, attention in torch.

The predictable path (`openvino.convert_model` + `compile_model("CPU")`), not
`torch.compile(backend="openvino")`, whose dynamo backend silently falls back to Inductor on any
conversion error. The model, through core's `PiecewiseModel` seam, is cut at its attention
calls into ``num_layers + 1`` segments (`segments.py`). Each
segment is converted once with a dynamic token axis, so any batch shape runs without
recompiling. Paged attention (which writes the KV cache in place) stays in the platform's
attention backend between segments. Tensor parallel size 1 only (the all-reduces inside a
segment would need OpenVINO collectives).
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

import torch

from portside.backends.cpu.segments import make_segments, run_segments
from portside.contract import ForwardContext, GraphRunner, ModelFn, PiecewiseModel

logger = logging.getLogger(__name__)


def openvino_available() -> str | None:
    """None if `openvino` imports, else the reason."""
    try:
        import openvino  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the environment
        return f"openvino is not importable ({e}); pip install 'portside[openvino]'"
    return None


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
            raise ValueError("cpu graph mode 'openvino' needs a model that implements portside.contract.PiecewiseModel")
        config_of_model = getattr(model_fn, "config", None)
        if getattr(config_of_model, "num_experts", 0):
            raise ValueError(
                "cpu graph mode 'openvino' does not support mixture-of-experts models (the experts' grouped "
                "operator does not convert to OpenVINO); use --cpu-graph eager or inductor"
            )
        self.model: PiecewiseModel = model_fn
        self.num_ov_calls = 0
        self._requests: list[Any] = []
        self._compiled: list[Any] = []
        self._build()
        self._segment_fns = [functools.partial(self._infer, i) for i in range(len(self._compiled))]

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
        modules = make_segments(model)
        segments = [(modules[0], *head), *((m, *mid) for m in modules[1:-1]), (modules[-1], *tail)]
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
        return run_segments(self.model, self._segment_fns, input_ids, positions, ctx)
