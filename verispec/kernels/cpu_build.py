"""Our C kernels for a CPU (`*.c` beside their Python wrappers): compiled at first use with the
system's C compiler (`cc`, or $CC) for this CPU (-march=native, OpenMP: the runtime torch already
loaded, so our parallel regions run on torch's threads), cached under ~/.cache/verispec (or
$XDG_CACHE_HOME/verispec) by the sources and the flags, and called through ctypes (which releases
the GIL for the call). Without a compiler a caller falls back to torch, its reason logged.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Callable

from verispec import log

# no FMA contraction the source does not spell: a sum's operations are the same wherever the
# compiler inlines or specialises it, so a row's bits do not depend on the code path taken
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC")


class Library:
    """One C source, built and loaded once per process on first use. `includes`: the sources it
    #includes (their text is part of the build's cache key)."""

    def __init__(self, source: Path, declare: Callable[[ctypes.CDLL], None], includes: tuple[Path, ...] = ()):
        self.source, self.declare, self.includes = source, declare, includes
        self._lock = threading.Lock()
        self._library: ctypes.CDLL | None = None
        self._failure: str | None = None

    def get(self) -> ctypes.CDLL | None:
        """The loaded library, or None: `failure()` says why."""
        if self._library is not None:  # every product asks: no lock once loaded
            return self._library
        with self._lock:
            if self._library is None and self._failure is None:
                try:
                    self._library = self._load()
                except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                    self._failure = str(exc)
            return self._library

    def failure(self) -> str | None:
        self.get()
        return self._failure

    def _load(self) -> ctypes.CDLL:
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            raise RuntimeError(f"no C compiler (cc, gcc or $CC) to build {self.source.name}")
        text = b"".join(path.read_bytes() for path in (self.source, *self.includes))
        key = hashlib.sha256(text + " ".join((compiler, *FLAGS, _cpu_signature())).encode()).hexdigest()[:16]
        target = _cache_dir() / f"{self.source.stem}-{key}.so"
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # another process may build it too
                built = Path(tmp) / target.name
                run = subprocess.run([compiler, *FLAGS, str(self.source), "-o", str(built), "-lm"],
                                     capture_output=True, text=True)
                if run.returncode != 0:
                    raise RuntimeError(f"{compiler} failed on {self.source.name}: {run.stderr.strip()[-400:]}")
                os.replace(built, target)
            log.debug("built %s: %s", self.source.name, target)
        library = ctypes.CDLL(str(target))
        self.declare(library)
        return library


def _cpu_signature() -> str:
    """What -march=native compiles for: the CPU's feature flags where Linux lists them (a home
    directory shared by machines with other CPUs then keeps one build each)."""
    try:
        with open("/proc/cpuinfo") as info:
            flags = next((line for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {platform.processor()} {flags.strip()}"


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "verispec" / "kernels"
