"""The async bridge: hands each request to the engine's scheduler and its chunks to the event loop.

The engine batches every request it holds (continuous batching); its worker thread hands each
chunk to the request's asyncio queue (call_soon_threadsafe), so no thread waits per request and
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
from verispec.engine.types import GenerationChunk, merge_chunks

DISCONNECT_POLL_S = 0.2


class _Failed:
    def __init__(self, exc: BaseException):
        self.exc = exc


_FINISHED = object()


class EngineBridge:
    def __init__(self, engine, max_in_flight: int = 64):
        self.engine = engine
        # engines without submit() (test doubles): one pool thread per request in flight
        self._executor = ThreadPoolExecutor(max_workers=max_in_flight, thread_name_prefix="verispec-request")
        self._running: set[threading.Event] = set()  # cancel events of queued/running generations

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       cancel: threading.Event | None = None) -> AsyncIterator[GenerationChunk]:
        """Chunks of one generation as the engine makes them; closing this iterator stops it.

        Chunks that pile up while the consumer is busy are merged into one (a stream under load
        sends fewer, larger deltas instead of falling behind: each delta costs the event loop and
        the GIL the same whatever its size)."""
        cancel = cancel or threading.Event()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def put(item) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop closed (server shutdown): nobody is listening
                cancel.set()

        self._running.add(cancel)
        try:
            coalesce = self._start(prompt_ids, params, cancel, put)
            while True:
                item = await queue.get()
                while coalesce and not queue.empty() and isinstance(item, GenerationChunk) and item.finish_reason is None:
                    more = queue.get_nowait()
                    if not isinstance(more, GenerationChunk):
                        queue.put_nowait(more)  # keep an error / the end marker for the next turn
                        break
                    item = merge_chunks(item, more)
                if item is _FINISHED:
                    return
                if isinstance(item, _Failed):
                    raise item.exc
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            # A no-op after a normal finish; stops the engine when the consumer left early.
            cancel.set()
            self._running.discard(cancel)

    def _start(self, prompt_ids, params, cancel, put) -> bool:
        """The engine's scheduler takes the request (its worker calls `put` with each chunk), or, for
        an engine with only `generate` (test doubles, which script their chunk boundaries), a pool
        thread iterates it. Returns whether chunks that pile up may be merged."""
        submit = getattr(self.engine, "submit", None)
        if submit is not None:
            if cancel.is_set():
                put(_FINISHED)
                return True

            def sink(item) -> None:
                put(_Failed(item) if isinstance(item, BaseException) else item)

            submit(prompt_ids, params, sink, cancel)  # a request the engine refuses raises here
            return True

        def work() -> None:
            try:
                if not cancel.is_set():
                    for chunk in self.engine.generate(prompt_ids, params, cancel):
                        put(chunk)
            except BaseException as exc:  # handed to the request's task, which decides the response
                put(_Failed(exc))
            finally:
                put(_FINISHED)

        asyncio.get_running_loop().run_in_executor(self._executor, work)
        return False

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
