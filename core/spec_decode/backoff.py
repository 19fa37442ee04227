"""Back-off for proposals that keep failing: after a step whose every proposal was rejected, a
request is not speculated for 1 step, then 2, 4, ... up to `MAX_SKIP` after each further miss in a
row; any accepted proposal resets it. A verification step costs more than a plain decode step
(several query rows instead of one; about 2.7x a fused batch-1 step on the cpu backend), so text
that does not repeat itself, or a draft that disagrees with the target, then costs little more
than no speculation at all. Only speed depends on it: every proposal is verified."""

from __future__ import annotations

MAX_SKIP = 16  # most steps a request goes unspeculated after a miss


class ProposalBackoff:
    def __init__(self) -> None:
        self._misses: dict[str, int] = {}  # req_id -> drafts rejected whole in a row
        self._skip: dict[str, int] = {}  # req_id -> steps left without proposals

    def record(self, req_id: str, num_proposed: int, num_accepted: int) -> None:
        """A verified draft of `num_proposed` tokens, `num_accepted` of them accepted."""
        if num_proposed == 0:
            return
        if num_accepted:
            self._misses.pop(req_id, None)
            return
        misses = self._misses.get(req_id, 0) + 1
        self._misses[req_id] = misses
        self._skip[req_id] = min(2 ** (misses - 1), MAX_SKIP)

    def allows(self, req_id: str) -> bool:
        """Whether the request may be speculated this step (counts a skipped step down)."""
        left = self._skip.get(req_id, 0)
        if left:
            self._skip[req_id] = left - 1
            return False
        return True

    def forget(self, req_id: str) -> None:
        self._misses.pop(req_id, None)
        self._skip.pop(req_id, None)
