"""How `verispec serve` runs: uvicorn with connection limits, a bounded shutdown, and an exit when
the engine dies.

A dead engine exits the server (non-zero) rather than restarting it in place: the engine process
dies of what would kill a restart too (GPU memory, a driver fault, the OOM killer), reloading a
large model takes minutes during which the server could only refuse, and a supervisor (systemd,
a container's restart policy) already restarts a process that exits, with back-off and a log.
Before exiting, /health answers 503 and requests a 503 error for ENGINE_DEATH_GRACE_S.
"""
from __future__ import annotations

import asyncio
import resource
import threading
from typing import Callable

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from verispec import log
from verispec.engine.client import EngineClient

# A connection must send a whole request head this soon after connecting (or after its last
# response): idle and half-sent connections otherwise hold a file descriptor each forever.
HEAD_TIMEOUT_S = 10.0
KEEP_ALIVE_S = 5.0  # uvicorn's default, stated: an idle keep-alive connection closes after it
# On SIGTERM, open streams get this long to finish before they are cancelled and the engine closed.
SHUTDOWN_GRACE_S = 10.0
ENGINE_POLL_S = 0.2
ENGINE_DEATH_GRACE_S = 2.0
RESERVED_FILES = 64  # descriptors kept for the model's files, logs, pipes, the engine process


class HeadTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, plus a deadline for each request head (uvicorn's keep-alive timer
    starts only after a response, and stops at the first byte of the next head)."""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_timer = None
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # between requests, or a head not yet complete
            if self._head_timer is None:
                self._arm_head_timer()
        else:
            self._cancel_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._cancel_head_timer()
        # the next head's deadline starts now: part of it may have arrived before the response
        # finished (h11 buffers it, and uvicorn's keep-alive timer then never starts); an idle
        # connection meets the shorter keep-alive timeout first
        if self.conn.their_state is h11.IDLE:
            self._arm_head_timer()

    def connection_lost(self, exc) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def raise_open_file_limit() -> int:
    """Raise this process's soft limit on open files to the hard limit; returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def uvicorn_config(app, host: str, port: int) -> uvicorn.Config:
    """Connections beyond what the open-file limit allows get a 503 instead of failing accept()."""
    files = raise_open_file_limit()
    limit = None if files == resource.RLIM_INFINITY else max(files - RESERVED_FILES, 16)
    return uvicorn.Config(app, host=host, port=port, log_level="info", http=HeadTimeoutH11Protocol,
                          timeout_keep_alive=int(KEEP_ALIVE_S), timeout_graceful_shutdown=int(SHUTDOWN_GRACE_S),
                          limit_concurrency=limit)


class EngineWatch:
    """A thread that notices the engine's death (EngineClient.failure) and, after a grace period
    in which /health says why, calls `stop`. `reason` keeps what killed it."""

    def __init__(self, engine: EngineClient, stop: Callable[[], None], poll_s: float = ENGINE_POLL_S,
                 grace_s: float | None = None):
        self.engine = engine
        self.stop = stop
        self.poll_s = poll_s
        self.grace_s = ENGINE_DEATH_GRACE_S if grace_s is None else grace_s
        self.reason: str | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="verispec-engine-watch", daemon=True)

    def start(self) -> "EngineWatch":
        self._thread.start()
        return self

    def close(self) -> None:
        self._done.set()
        self._thread.join(timeout=self.poll_s + 1)

    def check(self) -> bool:
        """One look at the engine: True (and `reason` set) once it has died."""
        if self.reason is None:
            self.reason = self.engine.failure()
            if self.reason is not None:
                log.warning("%s: the server stops in %.0fs and exits with an error (a supervisor restarts it)",
                          self.reason, self.grace_s)
        return self.reason is not None

    def _watch(self) -> None:
        while not self._done.wait(self.poll_s):
            if self.check():
                self._done.wait(self.grace_s)
                self.stop()
                return


async def close_engine(engine: EngineClient) -> None:
    """At shutdown, off the loop: an engine process's close joins the child (seconds)."""
    await asyncio.to_thread(engine.close)
