"""`collective_rpc` on both ends: a rank runs a `CollectiveRPC` on its model runner
(`run_rpc`, never raising: a bad call must not kill the worker), and the engine turns the ranks'
`RPCReply`s into results (`rpc_results`, raising the first rank's error)."""

from __future__ import annotations

from typing import Any

from portside.distributed.messages import CollectiveRPC, RPCReply

# errors raised again on the engine side as their own type: bad input, a refused state
_RERAISED: dict[str, type[Exception]] = {"ValueError": ValueError, "TypeError": TypeError, "NotImplementedError": NotImplementedError}


def call_on(target: Any, msg: CollectiveRPC) -> Any:
    """`msg.method` on `target` (a method name, or a function taking the target first)."""
    if isinstance(msg.method, str):
        fn = getattr(target, msg.method, None)
        if msg.method.startswith("_") or not callable(fn):
            raise ValueError(f"collective_rpc: the model runner has no public method {msg.method!r}")
        return fn(*msg.args, **msg.kwargs)
    if not callable(msg.method):
        raise ValueError(f"collective_rpc: method must be a method name or a callable, got {type(msg.method).__name__}")
    return msg.method(target, *msg.args, **msg.kwargs)


def run_rpc(target: Any, rank: int, msg: CollectiveRPC) -> RPCReply:
    try:
        return RPCReply(rank, call_on(target, msg))
    except Exception as e:
        return RPCReply(rank, error_type=type(e).__name__, error=str(e))


def rpc_results(replies: dict[int, Any]) -> list[Any]:
    """Every rank's result, by rank; the first failed rank's error raised (ValueError, TypeError
    and NotImplementedError as themselves, any other as RuntimeError naming its type)."""
    for rank in sorted(replies):
        r = replies[rank]
        if not isinstance(r, RPCReply):
            raise RuntimeError(f"collective_rpc: rank {rank} answered {type(r).__name__}")
        if r.error_type is not None:
            cls = _RERAISED.get(r.error_type)
            raise cls(r.error) if cls is not None else RuntimeError(f"collective_rpc: rank {rank} raised {r.error_type}: {r.error}")
    return [replies[rank].result for rank in sorted(replies)]
