"""The async bridge: hands each request to the engine's scheduler and its chunks to the event loop.

The engine batches every request it holds (continuous batching); its worker thread hands each
chunk to the request's buffer on the event loop (call_soon_threadsafe), so no thread waits per
request and the loop stays free to accept connections, answer /health and notice clients that leave.
Every generation carries a threading.Event; setting it makes the engine drop the sequence at its
next step (its KV blocks freed), and a request whose client left while queued never starts.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
from typing import AsyncIterator, Callable, TypeVar

from fastapi import Request

from verispec.engine.client import EngineClient
from verispec.sampling.params import SamplingParams
from verispec.engine.types import GenerationChunk, merge_chunks
from verispec.server.prepare_lanes import PrepareLanes

DISCONNECT_POLL_S = 0.2
T = TypeVar("T")


class _Failed:
    def __init__(self, exc: BaseException):
        self.exc = exc


_FINISHED = object()


class _ChoiceCancel(threading.Event):
    """One choice's cancel event, also set while its request's is: the engine sets a generation's
    event when that generation ends, which must not stop the request's other choices, while a client
    leaving must stop them all. The engine polls `is_set` each step."""

    def __init__(self, request_cancel: threading.Event):
        super().__init__()
        self.request_cancel = request_cancel

    def is_set(self) -> bool:
        return super().is_set() or self.request_cancel.is_set()


class EngineBridge:
    def __init__(self, engine: EngineClient, merge_chunks: bool = True):
        self.engine = engine
        self.merge_chunks = merge_chunks  # see generate_choices
        self._running: set[threading.Event] = set()  # cancel events of queued/running generations
        # Rendering templates and tokenizing take seconds for a long prompt, which must not stall the
        # event loop (/health, other clients' streams), nor other clients' preparation.
        self.prepare_lanes = PrepareLanes()

    async def run_blocking(self, body_bytes: int, fn: Callable[..., T], *args) -> T:
        """`fn(*args)` off the event loop, on the preparation lane for a request body of that size."""
        return await self.prepare_lanes.run(body_bytes, fn, *args)

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       cancel: threading.Event | None = None) -> AsyncIterator[GenerationChunk]:
        """Chunks of one generation as the engine makes them; closing this iterator stops it."""
        async for _, chunk in self.generate_choices(prompt_ids, [params], cancel):
            yield chunk

    async def generate_choices(self, prompt_ids: list[int], params: list[SamplingParams],
                               cancel: threading.Event | None = None
                               ) -> AsyncIterator[tuple[int, GenerationChunk]]:
        """(choice index, chunk) pairs of one generation per entry of `params`, all sharing the
        prompt and running in the engine's batch at once, in the order the chunks arrive. Ends
        when every choice has finished; one failure ends them all (its exception is raised), as
        does closing this iterator or setting `cancel`.

        A choice's chunks that pile up while the consumer is busy are merged into one (a stream
        under load sends fewer, larger deltas instead of falling behind: each delta costs the event
        loop and the GIL about the same whatever its size), unless merge_chunks is off."""
        cancel = cancel or threading.Event()
        loop = asyncio.get_running_loop()
        pending: collections.deque = collections.deque()
        ready = asyncio.Event()

        def arrive(item) -> None:  # on the event loop
            pending.append(item)
            ready.set()

        def put(item) -> None:  # from any thread
            try:
                loop.call_soon_threadsafe(arrive, item)
            except RuntimeError:  # the loop closed (server shutdown): nobody is listening
                cancel.set()

        self._running.add(cancel)
        try:
            for i, p in enumerate(params):
                self._start(i, prompt_ids, p, cancel, put)
            num_running = len(params)
            while num_running:
                if not pending:
                    ready.clear()
                    await ready.wait()
                item = pending.popleft()
                if item is _FINISHED:
                    num_running -= 1
                    continue
                if isinstance(item, _Failed):
                    raise item.exc
                index, chunk = item
                while (self.merge_chunks and chunk.finish_reason is None and pending and isinstance(pending[0], tuple)
                       and pending[0][0] == index):
                    chunk = merge_chunks(chunk, pending.popleft()[1])
                yield index, chunk
        finally:
            # A no-op after a normal finish; stops every choice when the consumer left early.
            cancel.set()
            self._running.discard(cancel)

    def _start(self, index: int, prompt_ids: list[int], params: SamplingParams, cancel: threading.Event,
               put) -> None:
        """Start one choice: the engine's scheduler takes it, its worker calls `put` with each chunk."""
        if cancel.is_set():
            put(_FINISHED)
            return

        def sink(item) -> None:
            if isinstance(item, BaseException):
                put(_Failed(item))
                return
            put((index, item))
            if item.finish_reason is not None:
                put(_FINISHED)

        self.engine.submit(prompt_ids, params, sink, _ChoiceCancel(cancel))  # a request the engine refuses raises here

    def shutdown(self) -> None:
        for cancel in list(self._running):
            cancel.set()
        self.prepare_lanes.shutdown()
        self.engine.shutdown()


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
