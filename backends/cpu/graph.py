"""cpu graph runners: eager, or torch.compile (Inductor) over the whole model step."""

from __future__ import annotations

import torch

from portside.backend_api import EagerGraphRunner, ForwardContext, GraphRunner, ModelFn


class InductorGraphRunner(GraphRunner):
    """torch.compile with dynamic shapes; attention stays out of the graph (it loops on the host)."""

    name = "inductor"

    def __init__(self, model_fn: ModelFn, config) -> None:
        super().__init__(model_fn, config)
        self._compiled = torch.compile(model_fn, dynamic=True)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self._compiled(input_ids, positions, ctx)


def make_graph_runner(model_fn: ModelFn, config) -> GraphRunner:
    mode = config.option("cpu_graph", "eager")
    if mode == "inductor":
        return InductorGraphRunner(model_fn, config)
    return EagerGraphRunner(model_fn, config)
