"""An Inductor graph pass for the cpu runner's one-token graphs (imported when compiling: it
imports Inductor)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._inductor.custom_graph_pass import CustomGraphPass


class GemvAsReduction(CustomGraphPass):
    """Inductor pre-grad pass: `F.linear` of a single row becomes a multiply and a row sum.

    A one-token step (batch-1 decode) is a matrix-vector product per linear, bound by reading
    the weight. BLAS GEMV and oneDNN's packed kernel stream the `[out, in]` weight at a fraction of
    the read bandwidth (MKL sgemv 9.7 GB/s on the CI machine's Zen 4 against 25-34 GB/s for a plain
    sum); Inductor's fused, vectorized reduction over the contiguous `in` axis reads it at close to
    the sum's rate (19.7 GB/s on 1 thread, 25.7 on 2, before huge pages). Graphs of two or more
    rows keep the GEMM."""

    def uuid(self) -> str:  # lets Inductor's graph cache key on this pass
        return f"portside-gemv-as-reduction-1-{torch.__version__}"

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is not F.linear:
                continue
            x = node.args[0] if node.args else node.kwargs.get("input")
            weight = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
            bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            val = getattr(x, "meta", {}).get("example_value")
            if val is None or val.dim() != 2 or not isinstance(val.shape[0], int) or val.shape[0] != 1:
                continue
            with graph.inserting_before(node):
                y = graph.call_function(torch.sum, (graph.call_function(torch.mul, (x, weight)), -1))  # [out]
                y = graph.call_function(torch.unsqueeze, (y, 0))  # [1, out]
                if bias is not None:
                    y = graph.call_function(torch.add, (y, bias))
            node.replace_all_uses_with(y)
            graph.erase_node(node)
