"""Training progress: a bar on a terminal (tqdm when installed, else one rewritten line), and off a
terminal (logs, remote runs) one line every `interval_s` seconds, so captured output stays short."""
from __future__ import annotations

import sys
import time


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


class TrainProgress:
    def __init__(self, total: int, desc: str, enabled: bool | None = None, interval_s: float = 15.0,
                 initial: int = 0):
        self.total = total
        self.desc = desc
        self.count = initial
        self.interactive = sys.stderr.isatty() if enabled is None else enabled
        self.interval_s = interval_s
        self.t0 = time.perf_counter()
        self.start_count = initial
        self.last_line = 0.0
        self._bar = None
        if self.interactive:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, initial=initial, desc=desc, file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                self._bar = None

    def update(self, count: int, fraction: float, stats: str) -> None:
        """`count` steps done; `fraction` of the run done (steps or time budget, whichever is ahead)."""
        advanced = count - self.count
        self.count = count
        if self._bar is not None:
            self._bar.set_postfix_str(stats, refresh=False)
            self._bar.update(advanced)
            return
        now = time.perf_counter()
        elapsed = now - self.t0
        done = max(fraction, 1e-9)
        eta = elapsed * (1 - done) / done if count > self.start_count else 0.0
        width = 24
        filled = int(width * min(fraction, 1.0))
        line = (f"{self.desc} [{'#' * filled}{'.' * (width - filled)}] {100 * min(fraction, 1.0):3.0f}% "
                f"step {count}/{self.total} {stats} [{_duration(elapsed)}<{_duration(eta)}]")
        if self.interactive:
            sys.stderr.write("\r" + line + "\x1b[K")
            sys.stderr.flush()
        elif now - self.last_line >= self.interval_s or fraction >= 1.0:
            self.last_line = now
            sys.stderr.write(line + "\n")
            sys.stderr.flush()

    def note(self, line: str) -> None:
        """A line shown above the bar (evaluations, checkpoints)."""
        if self._bar is not None:
            self._bar.write(f"{self.desc}: {line}", file=sys.stderr)
            return
        if self.interactive:
            sys.stderr.write("\r\x1b[K")
        sys.stderr.write(f"{self.desc}: {line}\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.interactive:
            sys.stderr.write("\n")
            sys.stderr.flush()
