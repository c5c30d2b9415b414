"""Debug logging: silent unless VERISPEC_DEBUG=1, then one readable line per event on stderr."""
from __future__ import annotations

import logging
import os
import sys
import time

from verispec.config import debug_flag, env

_logger = logging.getLogger("verispec")


def setup_logging() -> None:
    if _logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[verispec] %(message)s"))
    _logger.addHandler(handler)
    _logger.propagate = False
    _logger.setLevel(logging.DEBUG if env().debug else logging.INFO)


def debug_enabled() -> bool:
    return debug_flag()


def debug(msg: str, *args) -> None:
    """Log under VERISPEC_DEBUG=1 only (fallbacks, per-request stats)."""
    if debug_flag():
        setup_logging()
        _logger.debug(msg, *args)


def info(msg: str, *args) -> None:
    setup_logging()
    _logger.info(msg, *args)


def warning(msg: str, *args) -> None:
    setup_logging()
    _logger.warning(msg, *args)


def exception(msg: str, *args) -> None:
    """An error with its traceback (always shown): a failed engine step."""
    setup_logging()
    _logger.error(msg, *args, exc_info=True)


def count(n: int, noun: str) -> str:
    """"1 draft", "2 drafts": a number and its noun, in a log line."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


_IMPORTED_AT = time.monotonic()


def process_age_s() -> float:
    """Seconds since this process started (from /proc on Linux; elsewhere since this module loaded)."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, after the command name
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
        return uptime_s - started_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED_AT


def startup_phase(name: str, seconds: float) -> None:
    """One start-up phase: its duration and the process's age, so a slow start shows where it went."""
    info("start-up: %s %.1fs (%.1fs since the process started)", name, seconds, process_age_s())
