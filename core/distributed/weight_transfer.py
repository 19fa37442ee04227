"""A weight-update group: a trainer in another process (rank 0) broadcasts new weights to every
rank of a running engine (ranks 1..N), which copy them into their parameters
(`LLM.init_weight_transfer` / `LLM.receive_weights` on the engine side, `WeightTransferGroup.send`
on the trainer's; docs/rl.md has the example).

The group is its own gloo process group over a TCP store that the trainer hosts, apart from the
engine's tensor- and pipeline-parallel groups (a worker's default group stays what it is), so it
moves host tensors on every platform; each engine rank receives every full tensor and keeps its
shard (`ModelRunner.update_weights`). One update is: the names, dtypes and shapes (broadcast as
one pickled object), every engine rank's verdict on them (the dry run of `update_weights`:
unknown names, wrong shapes or dtypes, a sleeping engine), then, only if every rank accepts,
the tensors in that order. A refusal raises ValueError on both sides with the rank's reason,
and nothing is sent or changed.
"""

from __future__ import annotations

import datetime
import pickle
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["WeightTransferGroup"]

_PREFIX = "portside-weight-transfer"


class WeightTransferGroup:
    """One member of the group: `rank` 0 is the trainer (it hosts the store at host:port), the
    engine's ranks are 1..world_size-1. Creating it blocks until every member has joined."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float = 600.0) -> None:
        if world_size < 2 or not 0 <= rank < world_size:
            raise ValueError(f"weight transfer group: rank {rank} of world_size {world_size} (need 0 <= rank < world_size, "
                             "world_size >= 2: the trainer and the engine's ranks)")
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
        self.store = dist.PrefixStore(_PREFIX, store)
        self.group: Any = dist.ProcessGroupGloo(self.store, rank, world_size, timeout)
        self.rank, self.world_size = rank, world_size
        self._round = 0

    # ---- the trainer (rank 0) ---------------------------------------------------------------

    def send(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Broadcast (Hugging Face name, tensor) pairs to the engine's ranks, which apply them
        (`receive`); returns how many. ValueError when an engine rank refuses them."""
        if self.rank != 0:
            raise ValueError("only the trainer (rank 0) sends weights")
        items = [(name, t.detach().to("cpu").contiguous()) for name, t in weights]
        self._object([(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in items])
        if self._vote(""):
            raise ValueError(f"the engine refused the weight update: {self._reason()}")
        for _, t in items:
            self._broadcast(t)
        return len(items)

    # ---- an engine rank ---------------------------------------------------------------------

    def receive(self, check: Callable[[list[tuple[str, torch.Tensor]]], None]) -> list[tuple[str, torch.Tensor]]:
        """The next update's (name, tensor) pairs. `check` sees them first as meta tensors and
        raises ValueError to refuse them (every member then raises, nothing is sent)."""
        meta = self._object(None)
        stand_ins = [(name, torch.empty(shape, dtype=getattr(torch, dtype), device="meta")) for name, dtype, shape in meta]
        reason = ""
        try:
            check(stand_ins)
        except ValueError as e:
            reason = str(e) or "refused"
        if self._vote(reason):
            raise ValueError(reason or f"another engine rank refused the weight update: {self._reason()}")
        out = []
        for name, t in stand_ins:
            buf = torch.empty(t.shape, dtype=t.dtype)
            self._broadcast(buf)
            out.append((name, buf))
        return out

    def close(self) -> None:
        """Leave the group, together: every member calls it (the trainer `close`, the engine
        `LLM.close_weight_transfer`), which waits for all of them, then ends the connections and
        threads. A member that exits while others still hold the group can abort on the way out
        (gloo's threads, the trainer's store): so the trainer, which hosts the store, returns only
        once every engine rank has shut its side down."""
        self.group.allreduce([torch.zeros(1, dtype=torch.int64)]).wait()
        self.group.shutdown()
        if self.rank == 0:
            self.store.wait([f"closed/{r}" for r in range(1, self.world_size)])
        else:
            self.store.set(f"closed/{self.rank}", "1")

    # ---- plumbing -----------------------------------------------------------------------------

    def _broadcast(self, t: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([t], opts).wait()

    def _object(self, obj: object) -> Any:
        """Rank 0's `obj` on every member."""
        size = torch.zeros(1, dtype=torch.int64)
        data = b""
        if self.rank == 0:
            data = pickle.dumps(obj)
            size[0] = len(data)
        self._broadcast(size)
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0 else torch.empty(int(size[0]), dtype=torch.uint8)
        self._broadcast(buf)
        return obj if self.rank == 0 else pickle.loads(buf.numpy().tobytes())

    def _vote(self, reason: str) -> int:
        """Every member's verdict (an empty `reason`: accept); how many refused."""
        self._round += 1
        self.store.set(f"{self._round}/{self.rank}", reason)
        n = torch.tensor([1 if reason else 0], dtype=torch.int64)
        self.group.allreduce([n]).wait()
        return int(n[0])

    def _reason(self) -> str:
        for r in range(1, self.world_size):
            reason = self.store.get(f"{self._round}/{r}").decode()
            if reason:
                return f"rank {r}: {reason}"
        return "unknown reason"
