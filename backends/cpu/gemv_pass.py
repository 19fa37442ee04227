"""An Inductor graph pass for the cpu runner's one-token graphs, and the op it uses (imported
when compiling: it imports Inductor; the op must be registered wherever the graphs run)."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch._inductor.custom_graph_pass import CustomGraphPass

from portside.backends.cpu import native_ops

logger = logging.getLogger(__name__)


@torch.library.custom_op("portside_cpu::materialize", mutates_args=())
def materialize(x: torch.Tensor) -> torch.Tensor:
    """A copy of `x` that Inductor cannot inline into its consumer (an opaque op's input and
    output are real buffers)."""
    return x.clone()


@materialize.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


# Ops that only reshape: a linear's input behind them is as realized as their own input.
_VIEWS = {"view", "reshape", "flatten", "contiguous", "squeeze", "unsqueeze", "getitem"}


def _is_buffer(node: object) -> bool:
    """Whether `node` is, up to reshapes, a graph input or an opaque op's output: data that
    already sits in memory, so reading it from a fused reduction costs no recomputation."""
    while isinstance(node, torch.fx.Node):
        if node.op in ("placeholder", "get_attr"):
            return True
        if isinstance(node.target, (torch._ops.OpOverloadPacket, torch._ops.OpOverload)):
            return True
        if getattr(node.target, "__name__", str(node.target)) not in _VIEWS or not node.args:
            return False
        node = node.args[0]
    return False


class GemvAsReduction(CustomGraphPass):
    """Inductor pre-grad pass: `F.linear` of a single fp32 or bf16 row becomes the native C++
    operator `portside_cpu_native::linear_row` (`native_ops.py`) when it builds here, else (and for
    other dtypes) a multiply and a row sum that Inductor fuses.

    A one-token step (batch-1 decode) is a matrix-vector product per linear, bound by reading
    the weight. BLAS GEMV and oneDNN's packed kernel stream the `[out, in]` weight at a fraction of
    the read bandwidth (MKL sgemv 9.7 GB/s on the CI machine's Zen 4 against 25-34 GB/s for a plain
    sum); Inductor's fused, vectorized reduction over the contiguous `in` axis reads it at close to
    the sum's rate (19.7 GB/s on 1 thread, 25.7 on 2, before huge pages). Graphs of two or more
    rows keep the GEMM.

    The row is first materialized when it is computed in the graph (an RMSNorm before the QKV
    and gate/up projections): Inductor would otherwise inline its producer into the reduction
    and recompute it for every output row (one-token graph of the default model, 1 thread:
    norm + GEMV fused 14.6 GB/s, materialized first 25.2 GB/s, plain sum 33.5 GB/s).

    The native operator walks two streams of rows per thread: over the default model's weights
    in huge pages, 2 threads, 49.3 GB/s against ~33 for the fused reduction (a plain sum of the
    same matrices: 53.4). bf16 weights stream at half the bytes, widened in its dot products with
    fp32 sums (on a Zen 3 without bf16 instructions no faster than the fused reduction: batch-1
    bf16 decode 23-32 ms/token either way, within the VM's noise).

    With `amx_rows`, a bf16 linear whose row count the graph bounds to 2..`amx_rows` (`graph._compile`
    marks the token axis so for its few-rows graphs) becomes `portside_cpu_native::linear_amx`, the
    AMX tile kernel (`eager_linears`, option ``cpu_bf16_linears``)."""

    def __init__(self, native: bool = True, amx_rows: int = 0) -> None:
        """`native`: use the C++ operator if it builds here (False: always the fused reduction);
        `amx_rows`: the most rows of a linear sent to the AMX kernel (0: none)."""
        if native:
            reason = native_ops.not_ready_reason()  # (built in the background: the graphs keep the reduction)
            if reason:
                logger.warning("one-row linears use Inductor's fused reduction: the native operator is "
                               "unavailable (%s)", reason)
            native = reason is None
        self.native = native
        self.amx_rows = amx_rows if native else 0

    def uuid(self) -> str:  # lets Inductor's graph cache key on this pass
        return f"portside-gemv-as-reduction-5-{self.native}-{self.amx_rows}-{torch.__version__}"

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is not F.linear:
                continue
            x = node.args[0] if node.args else node.kwargs.get("input")
            weight = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
            bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            val = getattr(x, "meta", {}).get("example_value")
            if val is None or val.dim() != 2:
                continue
            one_row = isinstance(val.shape[0], int) and val.shape[0] == 1
            amx = (self.amx_rows and val.dtype == torch.bfloat16 and 1 < _most_rows(val.shape[0]) <= self.amx_rows
                   and getattr(weight, "op", None) in ("placeholder", "get_attr"))  # a computed weight: repacked every call
            if not (one_row or amx):
                continue
            with graph.inserting_before(node):
                if amx:
                    y = graph.call_function(torch.ops.portside_cpu_native.linear_amx.default, (x, weight, bias))
                elif self.native and val.dtype in (torch.float32, torch.bfloat16):
                    y = graph.call_function(torch.ops.portside_cpu_native.linear_row.default, (x, weight, bias))
                else:
                    y = _mul_sum(graph, x, weight, bias)
            node.replace_all_uses_with(y)
            graph.erase_node(node)


def _most_rows(rows: int | torch.SymInt) -> int:
    """The largest value a row count can take in the graph (its range's upper bound when
    symbolic; 0 when unbounded)."""
    if isinstance(rows, int):
        return rows
    node = rows.node
    upper = node.shape_env.bound_sympy(node.expr).upper
    return int(upper) if getattr(upper, "is_Integer", False) else 0  # else unbounded (sympy's or torch's infinity)


def _mul_sum(graph: torch.fx.Graph, x: torch.fx.Node, weight: torch.fx.Node, bias: torch.fx.Node | None) -> torch.fx.Node:
    """`F.linear` of one row as nodes Inductor fuses into one reduction per output element."""
    if not _is_buffer(x):
        x = graph.call_function(torch.ops.portside_cpu.materialize, (x,))
    y = graph.call_function(torch.sum, (graph.call_function(torch.mul, (x, weight)), -1))  # [out]
    y = graph.call_function(torch.unsqueeze, (y, 0))  # [1, out]
    if bias is not None:
        y = graph.call_function(torch.add, (y, bias))
    return y
