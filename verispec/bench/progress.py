"""Progress for long benchmark runs: tqdm on a terminal when it is installed, else a counter.

Off a terminal (logs, the device tool) only one line per finished row is printed, so captured
output stays short.
"""
from __future__ import annotations

import sys


class Progress:
    def __init__(self, total: int, desc: str = "bench", enabled: bool | None = None):
        self.total = total
        self.count = 0
        self.desc = desc
        self.interactive = sys.stderr.isatty() if enabled is None else enabled
        self._bar = None
        if self.interactive:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True)
            except ImportError:
                self._bar = None

    def step(self, what: str) -> None:
        """One unit of work (a warm-up or a timed run) is done."""
        self.count += 1
        if self._bar is not None:
            self._bar.set_postfix_str(what, refresh=False)
            self._bar.update(1)
        elif self.interactive:
            sys.stderr.write(f"\r{self.desc}: {self.count}/{self.total} {what}\x1b[K")
            sys.stderr.flush()

    def note(self, line: str) -> None:
        """A finished row, always shown (above the bar on a terminal)."""
        if self._bar is not None:
            self._bar.write(f"{self.desc}: {line}", file=sys.stderr)
        else:
            if self.interactive:
                sys.stderr.write("\r\x1b[K")
            sys.stderr.write(f"{self.desc}: {line}\n")
            sys.stderr.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.interactive:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
