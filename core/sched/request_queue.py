"""The waiting queue, kept in the policy's order."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator

from portside.request import Request
from portside.sched.policy import FCFSPolicy, Policy


class WaitingQueue:
    """Requests not running, in scheduling order.

    New requests join by the policy's key (arrival for fcfs: the back). `prepend` puts a
    preempted request back: at the very front under fcfs, by its key under priority. Waiting
    queues are short (hundreds), so a sorted list beats a heap: iteration in order is free.
    """

    def __init__(self, policy: Policy) -> None:
        self._policy = policy
        self._items: list[tuple[tuple[float, ...], int, Request]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter([item[2] for item in self._items])

    def __contains__(self, request: Request) -> bool:
        return any(item[2] is request for item in self._items)

    def add(self, request: Request) -> None:
        if isinstance(self._policy, FCFSPolicy):
            self._items.append(((), next(self._seq), request))  # arrival order = insertion order
        else:
            bisect.insort(self._items, (self._policy.sort_key(request), next(self._seq), request), key=_key)

    def prepend(self, request: Request) -> None:
        if isinstance(self._policy, FCFSPolicy):
            self._items.insert(0, ((), -next(self._seq), request))
        else:
            self.add(request)

    def remove(self, request: Request) -> None:
        for i, item in enumerate(self._items):
            if item[2] is request:
                del self._items[i]
                return
        raise ValueError(f"{request} is not waiting")


def _key(item: tuple[tuple[float, ...], int, Request]) -> tuple[tuple[float, ...], int]:
    return item[0], item[1]
