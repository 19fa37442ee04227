"""Scheduling policies: the order of the waiting queue and the choice of preemption victim.

- "fcfs": waiting requests by arrival; a preempted request goes back to the front. The victim is
  the most recently admitted running request.
- "priority": waiting requests by (priority, arrival), lower priority value first; a preempted
  request is re-inserted by that key. The victim is the running request with the largest
  (priority, arrival), i.e. the lowest priority, newest among equals.
"""

from __future__ import annotations

from collections.abc import Sequence

from portside.request import Request


class FCFSPolicy:
    name = "fcfs"

    def sort_key(self, request: Request) -> tuple[float, ...]:
        return (request.arrival_time,)

    def pick_victim(self, running: Sequence[Request]) -> Request:
        return running[-1]


class PriorityPolicy:
    name = "priority"

    def sort_key(self, request: Request) -> tuple[float, ...]:
        return (request.priority, request.arrival_time)

    def pick_victim(self, running: Sequence[Request]) -> Request:
        # max() keeps the first of equals: scan newest first so the newest one wins a tie
        return max(reversed(running), key=self.sort_key)


Policy = FCFSPolicy | PriorityPolicy


def make_policy(name: str) -> Policy:
    if name == "fcfs":
        return FCFSPolicy()
    if name == "priority":
        return PriorityPolicy()
    raise ValueError(f"unknown scheduling policy {name!r}; use 'fcfs' or 'priority'")
