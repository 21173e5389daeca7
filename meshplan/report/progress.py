"""The search's progress bar on stderr (:class:`ProgressBar`), for
:func:`meshplan.search.driver.search`'s ``progress`` callback."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn


class ProgressBar:
    """A rich progress bar on stderr for :func:`meshplan.search.driver.search`'s ``progress``
    callback, shown only once the search has run for ``after_s`` seconds (a search that
    takes a moment prints none) and only on a terminal. Use as a context manager."""

    def __init__(self, after_s: float = 0.5, console: Console | None = None):
        self.clock, self.after_s = time.perf_counter, after_s
        self.console = console or Console(stderr=True)
        self.t0 = self.clock()
        self.bar: Progress | None = None
        self.tasks: dict[str, TaskID] = {}

    def __enter__(self) -> "ProgressBar":
        self.t0 = self.clock()
        return self

    def __call__(self, label: str, done: int, total: int) -> None:
        if self.bar is None:
            if self.clock() - self.t0 < self.after_s or not self.console.is_terminal:
                return
            self.bar = Progress(TextColumn("search: {task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), console=self.console, transient=True)
            self.bar.start()
        if label not in self.tasks:
            self.tasks[label] = self.bar.add_task(label, total=total)
        self.bar.update(self.tasks[label], completed=done, total=total)

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()
