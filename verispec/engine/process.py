"""The engine in a process of its own, behind a proxy with the Engine's serving surface.

Why: in one process the engine's worker and the server's event loop share the GIL. A small model
steps in well under a millisecond and each client's stream costs the loop JSON, SSE and socket
work per chunk, so 8 HTTP clients got 1.1-1.8x one client's throughput where the engine alone
gives 5-7x (docs/benchmarks.md). With the engine in a child process, its steps and the server's
streaming run in parallel; what crosses between them is one pickled batch of chunks per send.

Shape (vLLM's engine core over ZMQ is the same idea; ours is a multiprocessing Pipe):
- the child (`spawn`, so CUDA starts clean) loads the engine from the EngineConfig, says ready with
  what the server needs to know (limits, names, the cache budget, the draft schedule), then takes
  messages: submit / cancel / call; its engine's sinks put (request id, chunk) on an outbox that a
  sender thread drains into one message per send;
- the parent (`EngineProcess`) checks each request as the Engine would (engine/limits.py), so a
  request that cannot fit is refused before any response starts; its reader thread hands each
  chunk to the request's sink, and forwards cancellations (a client that left) every
  CANCEL_POLL_S. Errors the child meets while starting a request (a grammar its library refuses)
  come back through the sink as the request's first item: the server's first_chunk() turns
  them into an HTTP error.
- if the child dies, every open request fails with an error saying so, later submits are refused,
  and `failure()` says why (the server's /health turns 503 and it exits: server/lifecycle.py).
- nothing the server calls blocks on the child: messages to it go through an outbox that a sender
  thread writes to the pipe (a stopped child's full pipe blocks that thread, not the event loop).
"""
from __future__ import annotations

import itertools
import multiprocessing
import pickle
import signal
import sys
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from verispec import log
from verispec.config import EngineConfig
from verispec.engine.client import ServedEngine
from verispec.engine.limits import RequestLimits
from verispec.sampling.params import SamplingParams
from verispec.errors import EngineUnavailableError

CANCEL_POLL_S = 0.05  # how often the parent looks for requests whose client left
START_TIMEOUT_S = 3600.0  # loading a large model from a slow disk, or downloading it
CALL_TIMEOUT_S = 600.0  # prewarm compiles kernels and captures graphs
STOP_TIMEOUT_S = 10.0
SWITCH_INTERVAL_S = 0.001


STATS_TIMEOUT_S = 5.0  # /metrics asks off the event loop; a stopped child must not hold that thread long


class EngineProcessError(EngineUnavailableError):
    """The engine's process failed to start or exited."""


@dataclass
class EngineInfo:
    """What the server reads from an engine, sent by the child once its engine is built."""

    model_name: str
    model_dir: str
    config: EngineConfig
    limits: RequestLimits
    eos_token_ids: list[int]
    method: str
    num_drafts: int
    drafts: str  # the draft policy's description (updated by a "drafts" message when it changes)
    budget: object  # cache.paged.CacheBudget
    device: str
    dtype: str
    device_name: str | None = None  # the GPU's name (asked here, so the server never starts CUDA)


def _local_model_dir(model: str | None) -> Path | None:
    """Where `model` is without downloading it (None where only a download would find it, or nowhere:
    the child then says why)."""
    from verispec.loading.resolve import resolve_model

    if model is None:
        return None
    try:
        return resolve_model(model, allow_download=False)
    except Exception:  # noqa: BLE001 - the child resolves it again and reports what is wrong
        return None


# ---- the child ------------------------------------------------------------------------------------
# What the parent may call on the child's engine (EngineProcess._call), by name.
_CALLS: dict[str, Callable] = {"load_stats": lambda engine: engine.load_stats(),
                               "prefix_cache_stats": lambda engine: engine.prefix_cache_stats(),
                               "prewarm": lambda engine: engine.prewarm()}


def _child_main(config: EngineConfig, conn) -> None:
    from verispec.engine.engine import Engine

    # Ctrl-C reaches the whole process group: the parent decides when this process stops
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # the engine's worker, the receiver (this thread) and the sender share the GIL, as in the server
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        engine = Engine.load(config)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("failed", exc))
        return
    outbox: queue.SimpleQueue = queue.SimpleQueue()
    # the policy changes after start (--draft-costs measure times the passes at the first step)
    engine.on_drafts_changed = lambda text: outbox.put(("drafts", text))
    conn.send(("ready", EngineInfo(engine.model_name, str(engine.model_dir), engine.config, engine.limits,
                                   list(engine.eos_token_ids), engine.method, engine.num_drafts,
                                   engine.describe_drafts(), engine.budget, str(engine.device),
                                   str(engine.dtype).removeprefix("torch."),
                                   torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else None)))
    sender = threading.Thread(target=_send_outbox, args=(outbox, conn), name="verispec-engine-sender", daemon=True)
    sender.start()
    cancels: dict[int, threading.Event] = {}
    try:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):  # the parent is gone
                break
            kind = message[0]
            if kind == "submit":
                _, rid, prompt_ids, params = message
                cancels[rid] = threading.Event()
                _child_submit(engine, rid, prompt_ids, params, cancels, outbox)
            elif kind == "cancel":
                event = cancels.get(message[1])
                if event is not None:
                    event.set()
            elif kind == "call":
                _, token, name = message
                try:
                    outbox.put(("reply", token, _CALLS[name](engine), None))
                except Exception as exc:  # noqa: BLE001 - raised in the parent
                    outbox.put(("reply", token, None, _picklable(exc)))
            elif kind == "stop":
                break
    finally:
        engine.close()  # cancels every request; a tensor-parallel engine's ranks stop too
        outbox.put(None)
        sender.join(timeout=STOP_TIMEOUT_S)


def _child_submit(engine, rid: int, prompt_ids: list[int], params: SamplingParams,
                  cancels: dict[int, threading.Event], outbox: queue.SimpleQueue) -> None:
    def sink(item) -> None:  # on the engine's worker thread
        if isinstance(item, BaseException):
            item = _picklable(item)
        outbox.put((rid, item))
        if isinstance(item, BaseException) or item.finish_reason is not None:
            cancels.pop(rid, None)

    try:
        engine.submit(prompt_ids, params, sink, cancels[rid])
    except Exception as exc:  # noqa: BLE001 - the request's first item: the server answers with its status
        sink(exc)


def _picklable(exc: BaseException) -> BaseException:
    """The exception itself if it crosses the pipe, else a RuntimeError naming it (the parent's
    reader must never meet a message it cannot unpickle)."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any failure to round-trip
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _send_outbox(outbox: queue.SimpleQueue, conn) -> None:
    """Everything the engine produced since the last send, as one message: a step of 64 sequences
    is one pickle and one write, not 64."""
    while True:
        first = outbox.get()
        batch = [first]
        while True:
            try:
                batch.append(outbox.get_nowait())
            except queue.Empty:
                break
        # chunks are (request id, chunk); control messages ("reply", "drafts") start with their kind
        chunks = [item for item in batch if item is not None and not isinstance(item[0], str)]
        try:
            if chunks:
                conn.send(("chunks", chunks))
            for item in batch:
                if item is not None and isinstance(item[0], str):
                    conn.send(item)
        except (BrokenPipeError, EOFError, OSError):  # the parent is gone
            return
        if any(item is None for item in batch):
            return


# ---- the parent -----------------------------------------------------------------------------------
class EngineProcess(ServedEngine):
    """An Engine in a child process, with what the server uses of one (engine/client.py's
    EngineClient): submit, the request checks, tokenizer, names, grammar checks, describe(),
    load_stats, prewarm, shutdown, close; and the public attributes describe() reads (config, cache
    budget, method, device; the draft policy's description as the child last sent it)."""

    def __init__(self, config: EngineConfig, while_loading: Callable[[], object] | None = None):
        """Starts the child and returns once its engine is ready; `while_loading` is work of the
        caller's (the server's imports) done meanwhile, as is the server's tokenizer."""
        from verispec.grammar.constraint import GrammarCompiler
        from verispec.loading.tokenizer import Tokenizer

        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe(duplex=True)
        self._process = context.Process(target=_child_main, args=(config, child_conn), name="verispec-engine",
                                        daemon=True)
        t0 = time.perf_counter()
        self._process.start()
        child_conn.close()
        # the child's phases count from its own start (log.process_age_s): this is where they begin
        log.info("start-up: the engine process started (%.1fs since this process started)", log.process_age_s())
        if while_loading is not None:
            while_loading()
        # the server's own tokenizer is built while the child loads (a GGUF's takes seconds), from
        # the checkpoint the child will find: a local one (the child alone downloads)
        early_dir, early = _local_model_dir(config.model), None
        if early_dir is not None:
            try:
                early = Tokenizer.from_dir(early_dir)
            except Exception:  # noqa: BLE001 - the child meets it too, and its error is the one raised
                early_dir = None
        info = self._wait_ready()
        self.config, self.model_name, self.model_dir = info.config, info.model_name, Path(info.model_dir)
        self.limits, self.method, self.num_drafts = info.limits, info.method, info.num_drafts
        self.max_model_len, self.vocab_size = info.limits.max_model_len, info.limits.vocab_size
        self._drafts, self.budget = info.drafts, info.budget
        self.device, self.dtype = torch.device(info.device), getattr(torch, info.dtype)
        self.device_name = info.device_name
        self.tokenizer = early if early_dir == self.model_dir else Tokenizer.from_dir(self.model_dir)
        self.tokenizer.eos_token_ids = list(info.eos_token_ids)  # the engine's (generation config's too)
        self.eos_token_ids = self.tokenizer.eos_token_ids
        # grammar checks before a request starts (server/prepare.py); the child compiles its own
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._requests: dict[int, tuple[Callable, threading.Event, bool]] = {}  # id -> (sink, cancel, sent)
        self._replies: dict[int, list] = {}
        self._reply_ready = threading.Condition(self._lock)
        self._ids = itertools.count()
        self._dead: str | None = None
        self._stopping = False
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_outbox, name="verispec-engine-writer", daemon=True)
        self._sender.start()
        self._reader = threading.Thread(target=self._read, name="verispec-engine-reader", daemon=True)
        self._reader.start()
        log.debug("engine process %d ready in %.1fs", self._process.pid, time.perf_counter() - t0)

    def describe_drafts(self) -> str:
        return self._drafts

    def _wait_ready(self) -> EngineInfo:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._conn.poll(1.0):
            if not self._process.is_alive():
                raise EngineProcessError(f"the engine process exited while loading (exit code "
                                         f"{self._process.exitcode}); its log above says why")
            if time.monotonic() > deadline:
                self._process.kill()
                raise EngineProcessError(f"the engine process was not ready after {START_TIMEOUT_S:.0f}s")
        try:
            kind, payload = self._conn.recv()
        except (EOFError, OSError) as exc:
            self._process.join(timeout=STOP_TIMEOUT_S)
            raise EngineProcessError(f"the engine process exited while loading (exit code "
                                     f"{self._process.exitcode}); its log above says why") from exc
        if kind == "failed":
            self._process.join(timeout=STOP_TIMEOUT_S)
            raise payload  # the loading error itself (a bad -m, an unsupported checkpoint)
        return payload

    # -- requests ------------------------------------------------------------------------------------
    def resolve_max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        return self.limits.max_new_tokens(num_prompt_tokens, params)

    def check_prompt_ids(self, prompt_ids: list[int]) -> None:
        self.limits.check_prompt_ids(prompt_ids)

    def submit(self, prompt_ids: list[int], params: SamplingParams, sink: Callable[[object], None],
               cancel: threading.Event | None = None) -> int:
        """As Engine.submit: bad requests raise here, chunks (or the error that ended the request)
        reach `sink` on the reader thread, setting `cancel` stops the request. Returns its id."""
        self.check_prompt_ids(prompt_ids)
        self.resolve_max_tokens(len(prompt_ids), params)
        if self._dead is not None:
            raise EngineProcessError(self._dead)
        rid = next(self._ids)
        with self._lock:
            self._requests[rid] = (sink, cancel or threading.Event(), False)
        self._send(("submit", rid, list(prompt_ids), params))
        return rid

    def _send(self, message) -> None:
        """Queue a message for the child; never blocks (a dead child raises)."""
        if self._dead is not None:
            raise EngineProcessError(self._dead)
        self._outbox.put(message)

    def _send_outbox(self) -> None:
        while True:
            message = self._outbox.get()
            if message is None:
                return
            try:
                with self._send_lock:
                    self._conn.send(message)
            except (BrokenPipeError, EOFError, OSError) as exc:
                self._fail_all(f"the engine process is gone ({exc})")
                return

    def _read(self) -> None:
        """Hands chunks to sinks; between messages, forwards the cancellations of clients that left."""
        while True:
            try:
                ready = self._conn.poll(CANCEL_POLL_S)
                message = self._conn.recv() if ready else None
            except (EOFError, OSError):
                self._process.join(timeout=STOP_TIMEOUT_S)
                self._fail_all(f"the engine process exited (exit code {self._process.exitcode})")
                return
            if message is not None and message[0] == "chunks":
                self._deliver(message[1])
            elif message is not None and message[0] == "drafts":
                self._drafts = message[1]
            elif message is not None and message[0] == "reply":
                _, token, value, exc = message
                with self._lock:
                    self._replies[token] = [value, exc]
                    self._reply_ready.notify_all()
            self._forward_cancels()

    def _deliver(self, items: list) -> None:
        for rid, item in items:
            with self._lock:
                entry = self._requests.get(rid)
                if entry is not None and (isinstance(item, BaseException) or item.finish_reason is not None):
                    del self._requests[rid]
            if entry is not None:
                try:
                    entry[0](item)
                except Exception:  # noqa: BLE001 - one client's sink must not stop the others'
                    log.exception("a request's sink failed")

    def _forward_cancels(self) -> None:
        with self._lock:
            leaving = [rid for rid, (sink, cancel, sent) in self._requests.items() if not sent and cancel.is_set()]
            for rid in leaving:
                sink, cancel, _ = self._requests[rid]
                self._requests[rid] = (sink, cancel, True)
        for rid in leaving:
            try:
                self._send(("cancel", rid))
            except EngineProcessError:
                return

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            if self._dead is None:
                self._dead = reason
                if not self._stopping:
                    log.warning("%s", reason)
            requests, self._requests = self._requests, {}
            self._reply_ready.notify_all()
        for sink, _, _ in requests.values():
            try:
                sink(EngineProcessError(reason))
            except Exception:  # noqa: BLE001
                log.exception("a request's sink failed")

    # -- calls into the child's engine ---------------------------------------------------------------
    def _call(self, name: str, timeout: float = CALL_TIMEOUT_S):
        token = next(self._ids)
        self._send(("call", token, name))
        deadline = time.monotonic() + timeout
        with self._lock:
            while token not in self._replies:
                if self._dead is not None:
                    raise EngineProcessError(self._dead)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EngineProcessError(f"the engine process did not answer {name}() in {timeout:.0f}s")
                self._reply_ready.wait(timeout=left)
            value, exc = self._replies.pop(token)
        if exc is not None:
            raise exc
        return value

    def load_stats(self) -> dict:
        return self._call("load_stats", timeout=STATS_TIMEOUT_S)

    def prefix_cache_stats(self) -> dict | None:
        return self._call("prefix_cache_stats", timeout=STATS_TIMEOUT_S)

    def failure(self) -> str | None:
        """Why the child can no longer run requests (None while it can, and once closed on purpose)."""
        return None if self._stopping else self._dead

    def prewarm(self) -> float:
        return self._call("prewarm")

    def gpu_name(self) -> str | None:
        """The child's answer: asking CUDA here would start a CUDA context in the server's process."""
        return self.device_name

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def shutdown(self) -> None:
        """Cancel every request (as Engine.shutdown: the engine stays usable; the server calls this
        when it stops). `close()` ends the process."""
        with self._lock:
            for _, cancel, _ in self._requests.values():
                cancel.set()
        self._forward_cancels()

    def close(self) -> None:
        """Cancel every request, then stop the child (it frees the GPU as it exits)."""
        self.shutdown()
        self._stopping = True
        if self._process.is_alive():
            try:
                self._send(("stop",))
            except EngineProcessError:
                pass
            self._process.join(timeout=STOP_TIMEOUT_S)
            if self._process.is_alive():
                log.info("the engine process did not stop in %.0fs: killing it", STOP_TIMEOUT_S)
                self._process.kill()
                self._process.join(timeout=STOP_TIMEOUT_S)
        self._outbox.put(None)
        self._sender.join(timeout=STOP_TIMEOUT_S)
        self._conn.close()
