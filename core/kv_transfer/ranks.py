"""One KV connector report from every rank's (tensor and pipeline parallelism; pure Python).

Each rank runs its own worker half over its part of every block (its KV heads, its stage's
layers) and reports its own `KVConnectorOutput` each step; the executor hands them all, by rank,
to `KVOutputAggregator.aggregate`, and the scheduler half sees the one it returns (vLLM's
KVOutputAggregator):

- a request's load is finished only once every rank has reported it finished (ranks load in the
  background and may finish in different steps);
- its good-block count is the smallest any rank reported: a block missing or damaged on one rank
  is recomputed from there on every rank;
- counters: bytes and damaged files (`corrupt_blocks`: each rank has its own files) are summed
  over the ranks; every other counter (loads, blocks, seconds) is rank 0's, since every rank moves
  the same blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

from portside.kv_transfer.base import KVConnectorOutput

__all__ = ["KVOutputAggregator"]

_SUMMED_OVER_RANKS = ("corrupt_blocks",)


class KVOutputAggregator:
    """Merges the ranks' per-step connector reports (see the module docstring)."""

    def __init__(self, num_ranks: int) -> None:
        if num_ranks < 1:
            raise ValueError(f"num_ranks must be at least 1, got {num_ranks}")
        self.num_ranks = num_ranks
        # req_id -> what each rank that finished its load reported: its good blocks (None: all)
        self._reports: dict[str, list[int | None]] = {}

    def aggregate(self, outputs: Sequence[KVConnectorOutput | None]) -> KVConnectorOutput | None:
        """The step's report for the scheduler half from every rank's (by rank; None: nothing);
        None when there is nothing to report."""
        if len(outputs) != self.num_ranks:
            raise ValueError(f"expected {self.num_ranks} ranks' KV connector outputs, got {len(outputs)}")
        merged = KVConnectorOutput()
        for rank, out in enumerate(outputs):
            if out is None:
                continue
            for req_id in out.finished_loading:
                self._reports.setdefault(req_id, []).append(out.failed_loading.get(req_id))
            for key, value in out.stats.items():
                if rank == 0 or key.endswith("_bytes") or key in _SUMMED_OVER_RANKS:
                    merged.stats[key] = merged.stats.get(key, 0.0) + value
        for req_id in [r for r, reports in self._reports.items() if len(reports) >= self.num_ranks]:
            reports = self._reports.pop(req_id)
            merged.finished_loading.add(req_id)
            failed = [good for good in reports if good is not None]
            if failed:
                merged.failed_loading[req_id] = min(failed)
        return merged if merged.finished_loading or merged.stats else None

    @property
    def num_partial(self) -> int:
        """Loads some ranks but not all have finished (diagnostics and tests)."""
        return len(self._reports)
