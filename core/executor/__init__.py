"""Executors: what runs the model runner on the ranks of one engine replica. The engine knows only
the `Executor` base (`base`); `make_executor` (`factory`) picks the implementation: in-process
(`uniproc`), worker processes (`multiproc`), Ray actors (`ray`) or a launcher's world
(`launched`). The executors whose ranks all run in workers share `workers`."""

from portside.executor.base import Executor
from portside.executor.factory import make_executor

__all__ = ["Executor", "make_executor"]
