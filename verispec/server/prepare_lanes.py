"""Request preparation (Unicode checks, template rendering, tokenizing) off the event loop, in two
lanes chosen by the size of the request body.

Small bodies (a chat turn, an ordinary prompt) have a lane of their own, so their preparation never
queues behind a large one's: a small request waits at most for the small ones ahead of it, each of
which tokenizes at most LARGE_BODY_BYTES of text. Large bodies share one thread among themselves,
where each costs at most about a context's worth of tokenizing (token_budget.py refuses longer
prompts early). Few threads: this is CPU work beside the engine's.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

# Bodies up to this size are "small": about 8 K tokens of English, tokenized in milliseconds.
LARGE_BODY_BYTES = 32 * 1024
SMALL_LANE_THREADS = 2
LARGE_LANE_THREADS = 1
T = TypeVar("T")


class PrepareLanes:
    def __init__(self, large_body_bytes: int = LARGE_BODY_BYTES):
        self.large_body_bytes = large_body_bytes
        self._small = ThreadPoolExecutor(max_workers=SMALL_LANE_THREADS, thread_name_prefix="verispec-prepare")
        self._large = ThreadPoolExecutor(max_workers=LARGE_LANE_THREADS,
                                         thread_name_prefix="verispec-prepare-large")

    def is_large(self, body_bytes: int) -> bool:
        return body_bytes > self.large_body_bytes

    async def run(self, body_bytes: int, fn: Callable[..., T], *args) -> T:
        """`fn(*args)` on the lane for a request whose body has `body_bytes` bytes."""
        lane = self._large if self.is_large(body_bytes) else self._small
        return await asyncio.get_running_loop().run_in_executor(lane, fn, *args)

    def shutdown(self) -> None:
        for lane in (self._small, self._large):
            lane.shutdown(wait=False, cancel_futures=True)
