"""Debug logging: silent unless VERISPEC_DEBUG=1, then one readable line per event on stderr."""
from __future__ import annotations

import logging
import sys

from verispec.config import env

_logger = logging.getLogger("verispec")


def setup_logging() -> None:
    if _logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[verispec] %(message)s"))
    _logger.addHandler(handler)
    _logger.propagate = False
    _logger.setLevel(logging.DEBUG if env().debug else logging.INFO)


def debug(msg: str, *args) -> None:
    """Log under VERISPEC_DEBUG=1 only (fallbacks, per-request stats)."""
    if env().debug:
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
