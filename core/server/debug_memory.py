"""Opt-in memory diagnostics for `portside serve` (used by `ci/bench/soak.py`).

With ``PORTSIDE_TRACEMALLOC=1`` in the environment the server starts `tracemalloc` at startup
and, on every SIGUSR1, appends a report to the file named by ``PORTSIDE_TRACEMALLOC_OUT``
(default ``portside-tracemalloc.txt``): a line ``current BYTES peak BYTES`` (traced size now, and
its peak since the previous report), then the top 20 allocation sites by growth since the previous
report, one a line: ``size_diff<TAB>size<TAB>count_diff<TAB>file:line`` (bytes), then a blank line. Without the variable nothing happens.
"""

from __future__ import annotations

import os
import signal
import threading
import tracemalloc
from types import FrameType

TOP = 20
_lock = threading.Lock()
_previous: tracemalloc.Snapshot | None = None


def write_report(path: str) -> None:
    """Append one report (sizes, then the top growth since the last report) to `path`."""
    global _previous
    with _lock:
        current, peak = tracemalloc.get_traced_memory()
        snapshot = tracemalloc.take_snapshot().filter_traces(
            (
                tracemalloc.Filter(False, tracemalloc.__file__),
                tracemalloc.Filter(False, "<frozen importlib._bootstrap*>"),
            )
        )
        stats = snapshot.compare_to(_previous, "lineno") if _previous is not None else snapshot.statistics("lineno")
        _previous = snapshot
        lines = [f"current {current} peak {peak}"]
        for s in stats[:TOP]:
            frame = s.traceback[0]
            diff = (
                (s.size_diff, s.size, s.count_diff)
                if isinstance(s, tracemalloc.StatisticDiff)
                else (s.size, s.size, s.count)
            )
            lines.append("\t".join([*map(str, diff), f"{frame.filename}:{frame.lineno}"]))
        tracemalloc.reset_peak()
        with open(path, "a", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n\n")


def install_from_env() -> None:
    """Start tracemalloc and the SIGUSR1 report handler when ``PORTSIDE_TRACEMALLOC=1``."""
    if os.environ.get("PORTSIDE_TRACEMALLOC") != "1":
        return
    path = os.environ.get("PORTSIDE_TRACEMALLOC_OUT", "portside-tracemalloc.txt")
    tracemalloc.start(int(os.environ.get("PORTSIDE_TRACEMALLOC_FRAMES", "1")))

    def on_signal(signum: int, frame: FrameType | None) -> None:
        # the snapshot takes a while: off the signal handler's frame, so the event loop only pauses
        threading.Thread(target=write_report, args=(path,), daemon=True).start()

    signal.signal(signal.SIGUSR1, on_signal)
