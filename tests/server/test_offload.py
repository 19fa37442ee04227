"""The offload lanes: work runs off the event loop, each lane is bounded (then 503), the lanes
do not wait on each other, and every worker thread tokenizes with its own tokenizer copy."""

from __future__ import annotations

import asyncio
import threading

import pytest

from portside.server.errors import APIError
from portside.server.offload import Offload


def test_lanes_are_bounded_and_independent() -> None:
    release = threading.Event()

    async def main() -> None:
        off = Offload(tokenizer={"a": 1}, max_queued=(2, 1))
        loop_thread = threading.get_ident()
        slow = asyncio.ensure_future(off.run(release.wait, large=True))  # occupies the large lane
        await asyncio.sleep(0.05)
        with pytest.raises(APIError) as e:  # the large lane holds one job: a second is refused
            await off.run(lambda: None, large=True)
        assert e.value.status == 503 and e.value.code == "server_busy"
        # the small lane still answers at once, on a thread of its own
        assert await asyncio.wait_for(off.run(threading.get_ident, large=False), 2) != loop_thread
        tokens = await off.run(off.tokenizer, large=False)
        assert tokens == {"a": 1} and tokens is not off._base and tokens is await off.run(off.tokenizer, large=False)
        release.set()
        assert await slow is True
        off.shutdown()

    asyncio.run(main())
