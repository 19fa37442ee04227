"""cpu graph runners, chosen by the ``cpu_graph`` platform option (``--cpu-graph``):

- ``eager``: the model runs op by op (the fallback every platform has);
- ``inductor``: ``torch.compile`` (Inductor, dynamic shapes) over the model step; paged attention
  is excluded from the graphs (`torch.compiler.disable`), so dynamo cuts one graph per layer gap;
- ``openvino``: the dense segments between attention calls as compiled OpenVINO models
  (`openvino_runner.OpenVinoGraphRunner`).
"""

from __future__ import annotations

import torch

from portside.backend_api import EagerGraphRunner, ForwardContext, GraphRunner, ModelFn

GRAPH_MODES = ("eager", "inductor", "openvino")
DEFAULT_GRAPH_MODE = "eager"


class InductorGraphRunner(GraphRunner):
    """torch.compile with dynamic shapes; attention runs eagerly between the compiled graphs."""

    name = "inductor"

    def __init__(self, model_fn: ModelFn, config) -> None:
        super().__init__(model_fn, config)
        self._compiled = torch.compile(model_fn, dynamic=True)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self._compiled(input_ids, positions, ctx)


def make_graph_runner(model_fn: ModelFn, config) -> GraphRunner:
    mode = config.option("cpu_graph", DEFAULT_GRAPH_MODE)
    if mode == "inductor":
        return InductorGraphRunner(model_fn, config)
    if mode == "openvino":
        from portside.backends.cpu.openvino_runner import OpenVinoGraphRunner

        return OpenVinoGraphRunner(model_fn, config)
    return EagerGraphRunner(model_fn, config)
