"""A one-line progress bar on stderr for simulator runs (no dependencies)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """`[#####.....]  45%  run 3/10 lumen  t=120.0 s` redrawn in place at most every `interval_s`."""

    def __init__(
        self, horizon_s: float, stream: TextIO | None = None, width: int = 30, interval_s: float = 0.2
    ):
        self.horizon_s = max(horizon_s, 1e-9)
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.interval_s = interval_s
        self._last = 0.0
        self._shown = False

    def __call__(self, run: int, runs: int, label: str, sim_t: float) -> None:
        now = time.monotonic()
        final = run >= runs
        if not final and now - self._last < self.interval_s:
            return
        self._last = now
        frac = 1.0 if final else (run + min(1.0, sim_t / self.horizon_s)) / max(1, runs)
        filled = round(frac * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        what = "done" if final else f"run {run + 1}/{runs} {label}  t={sim_t:.1f} s"
        self.stream.write(f"\r[{bar}] {frac * 100:5.1f}%  {what:<48}")
        if final:
            self.stream.write("\n")
        self.stream.flush()
        self._shown = True
