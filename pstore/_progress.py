"""A tiny dependency-free progress bar.

It animates in place (``\\r``) only when its stream is a terminal; elsewhere (a pipe, a log file,
CI) it stays silent until :meth:`Progress.close`, which writes one plain summary line. Messages
written through :meth:`Progress.write` never tear the bar.

Examples
--------
>>> with Progress(total=3, desc="work", unit="step", disable=True) as bar:
...     for _ in range(3):
...         bar.update()
"""

from __future__ import annotations

import shutil
import sys
import time
from types import TracebackType
from typing import TextIO

__all__ = ["Progress", "format_seconds"]


def format_seconds(seconds: float) -> str:
    """Format a duration: ``0.42 s``, ``12.3 s``, ``3:07`` or ``1:02:03``."""
    if seconds < 10:
        return f"{seconds:.2f} s"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds + 0.5), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class Progress:
    """A progress bar over ``total`` units of work.

    Parameters
    ----------
    total : int
        Units of work expected; 0 or less means unknown (a counter without a bar).
    desc : str
        Label shown before the bar.
    unit : str
        Name of one unit, shown in the rate and the summary line.
    stream : file-like, optional
        Where to draw; default ``sys.stderr`` at construction time.
    disable : bool
        Draw nothing and write no summary line.
    width : int
        Width of the bar in characters.
    min_interval : float
        Least number of seconds between two redraws.

    Notes
    -----
    Whether to animate is decided once, from ``stream.isatty()``.
    """

    def __init__(
        self,
        total: int,
        desc: str = "",
        unit: str = "it",
        stream: TextIO | None = None,
        disable: bool = False,
        width: int = 30,
        min_interval: float = 0.1,
    ) -> None:
        self.total = int(total)
        self.desc = desc
        self.unit = unit
        self.stream = stream if stream is not None else sys.stderr
        self.disable = disable
        self.width = max(1, int(width))
        self.min_interval = min_interval
        self.n = 0
        self.postfix = ""
        self.closed = False
        self.start = time.perf_counter()
        self._last_draw = -float("inf")
        self._drawn = False
        isatty = getattr(self.stream, "isatty", None)
        self.animate = not disable and callable(isatty) and bool(isatty())

    @property
    def elapsed(self) -> float:
        """Seconds since the bar was made."""
        return time.perf_counter() - self.start

    def update(self, n: int = 1, postfix: str | None = None) -> None:
        """Record ``n`` more units done, optionally replacing the text shown after the bar."""
        self.n += n
        if postfix is not None:
            self.postfix = postfix
        if self.animate:
            now = time.perf_counter()
            if now - self._last_draw >= self.min_interval or self.n == self.total:
                self._draw(now)

    def set_postfix(self, postfix: str) -> None:
        """Replace the text shown after the bar (redrawn on the next update)."""
        self.postfix = postfix

    def write(self, message: str, file: TextIO | None = None) -> None:
        """Write a line of text (to ``file``, default the bar's stream) without tearing the bar."""
        target = file if file is not None else self.stream
        if self.animate and self._drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
        target.write(message + "\n")
        target.flush()
        if self.animate and not self.closed:
            self._draw(time.perf_counter())

    def close(self) -> None:
        """Finish: a last redraw and newline on a terminal, else one plain summary line."""
        if self.closed:
            return
        self.closed = True
        if self.disable:
            return
        if self.animate:
            self._draw(time.perf_counter())
            self.stream.write("\n")
        else:
            self.stream.write(self._summary() + "\n")
        self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _rate(self) -> str:
        elapsed = self.elapsed
        rate = self.n / elapsed if elapsed > 0 else 0.0
        return f"{rate:.1f} {self.unit}/s"

    def _label(self) -> str:
        return f"{self.desc}: " if self.desc else ""

    def _summary(self) -> str:
        done = f"{self.n}/{self.total}" if self.total > 0 else str(self.n)
        tail = f", {self.postfix}" if self.postfix else ""
        return (
            f"{self._label()}{done} {self.unit} in {format_seconds(self.elapsed)} "
            f"({self._rate()}){tail}"
        )

    def _draw(self, now: float) -> None:
        self._last_draw = now
        self._drawn = True
        if self.total > 0:
            frac = min(1.0, self.n / self.total)
            filled = int(frac * self.width)
            bar = "#" * filled + "-" * (self.width - filled)
            eta = ""
            if 0 < self.n < self.total:
                eta = f" eta {format_seconds(self.elapsed * (self.total - self.n) / self.n)}"
            line = (
                f"{self._label()}{frac:4.0%} [{bar}] {self.n}/{self.total} "
                f"{format_seconds(self.elapsed)}{eta} {self._rate()}"
            )
        else:
            line = (
                f"{self._label()}{self.n} {self.unit} {format_seconds(self.elapsed)} {self._rate()}"
            )
        if self.postfix:
            line += f" {self.postfix}"
        # A line longer than the terminal would wrap, and "\r" could not erase it.
        columns = shutil.get_terminal_size().columns
        self.stream.write("\r\x1b[K" + line[: max(1, columns - 1)])
        self.stream.flush()
