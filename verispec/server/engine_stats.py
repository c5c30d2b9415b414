"""The engine's load for /metrics, read off the event loop.

`load_stats()` of an engine in its own process waits for the child's answer: in an async route
a stopped child froze every client of the server. Here one thread asks, one question at a time;
a scrape waits a little for the answer and otherwise renders the last one it had.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import Future, ThreadPoolExecutor

from verispec import log
from verispec.engine.client import EngineClient

STATS_WAIT_S = 1.0  # how long a scrape waits for a fresh answer before using the last one


class EngineStatsReader:
    def __init__(self, engine: EngineClient, wait_s: float = STATS_WAIT_S):
        self.engine = engine
        self.wait_s = wait_s
        self.last: dict | None = None
        self._asking: Future | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="verispec-stats")

    async def read(self) -> dict | None:
        """The engine's load stats, fresh when the engine answers in time, else the last known (None: none yet)."""
        if self.engine.failure() is not None:
            return self.last
        if self._asking is None or self._asking.done():
            self._asking = self._executor.submit(self.engine.load_stats)
        try:
            self.last = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self._asking)), self.wait_s)
        except asyncio.TimeoutError:
            log.debug("the engine did not report its load in %.1fs: /metrics shows the last report", self.wait_s)
        except Exception as exc:  # noqa: BLE001 - a metrics scrape never fails on the engine's account
            log.debug("the engine's load stats failed: %s", exc)
        return self.last

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
