"""The async bridge: hands each request to the engine's scheduler and its chunks to the event loop.

The engine batches every request it holds (continuous batching); here each in-flight request
waits for its chunks in a pool thread (`Engine.generate` blocks on the request's own queue), so
the event loop stays free to accept connections, answer /health and notice clients that leave.
Every generation carries a threading.Event; setting it makes the engine drop the sequence at its
next step (its KV blocks freed), and a request whose client left while queued never starts.
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator

from fastapi import Request

from verispec.engine.params import SamplingParams
from verispec.engine.types import GenerationChunk

DISCONNECT_POLL_S = 0.2


class _Failed:
    def __init__(self, exc: BaseException):
        self.exc = exc


_FINISHED = object()


class EngineBridge:
    def __init__(self, engine, max_in_flight: int = 1024):
        self.engine = engine
        # one waiting thread per request in flight; past this many, requests queue here first
        self._executor = ThreadPoolExecutor(max_workers=max_in_flight, thread_name_prefix="verispec-request")
        self._running: set[threading.Event] = set()  # cancel events of queued/running generations

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       cancel: threading.Event | None = None) -> AsyncIterator[GenerationChunk]:
        """Chunks of one generation as the engine makes them; closing this iterator stops it."""
        cancel = cancel or threading.Event()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def put(item) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop closed (server shutdown): nobody is listening
                cancel.set()

        def work() -> None:
            try:
                if not cancel.is_set():
                    for chunk in self.engine.generate(prompt_ids, params, cancel):
                        put(chunk)
            except BaseException as exc:  # handed to the request's task, which decides the response
                put(_Failed(exc))
            finally:
                put(_FINISHED)

        self._running.add(cancel)
        loop.run_in_executor(self._executor, work)
        try:
            while True:
                item = await queue.get()
                if item is _FINISHED:
                    return
                if isinstance(item, _Failed):
                    raise item.exc
                yield item
        finally:
            # A no-op after a normal finish; stops the engine when the consumer left early.
            cancel.set()
            self._running.discard(cancel)

    def shutdown(self) -> None:
        for cancel in list(self._running):
            cancel.set()
        self._executor.shutdown(wait=False, cancel_futures=True)
        stop = getattr(self.engine, "shutdown", None)
        if stop is not None:
            stop()


@contextlib.asynccontextmanager
async def cancel_on_disconnect(request: Request, cancel: threading.Event):
    """While inside, a side task sets `cancel` as soon as the client has disconnected."""

    async def watch() -> None:
        while not cancel.is_set():
            if await request.is_disconnected():
                cancel.set()
                return
            await asyncio.sleep(DISCONNECT_POLL_S)

    task = asyncio.create_task(watch())
    try:
        yield
    finally:
        task.cancel()
