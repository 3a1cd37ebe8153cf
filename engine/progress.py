"""Progress of long work (model conversion, weight loading): a bar for a person, log lines for a pipe."""

from __future__ import annotations

import sys
from collections.abc import Callable

Progress = Callable[[int, int], None]  # (steps done, total steps)


class ProgressReporter:
    """A tqdm bar when stderr is a TTY; otherwise a log line every 10 percent."""

    def __init__(self, description: str, log) -> None:
        self.description = description
        self.log = log
        self.is_tty = sys.stderr.isatty()
        self.bar = None
        self.next_percent = 0

    def __call__(self, done: int, total: int) -> None:
        if self.is_tty:
            if self.bar is None:
                from tqdm import tqdm
                self.bar = tqdm(total=total, desc=self.description, unit="step", file=sys.stderr)
            self.bar.update(done - self.bar.n)
            return
        percent = 100 * done // total
        if percent >= self.next_percent:
            self.log.info(self.description, done=done, total=total, percent=percent)
            self.next_percent = percent // 10 * 10 + 10

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
