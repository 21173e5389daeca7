"""The search's progress bar on stderr (:class:`ProgressBar`), for
:func:`meshplan.search.driver.search`'s ``progress`` callback."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn


#: Seconds between two plain progress lines off a terminal (a Slurm or CI log).
LINE_EVERY_S = 60.0


class ProgressBar:
    """A rich progress bar on stderr for :func:`meshplan.search.driver.search`'s ``progress``
    callback, shown only once the search has run for ``after_s`` seconds (a search that
    takes a moment prints none) and only on a terminal; off a terminal (stderr to a file or a
    batch job's log) one plain line at most every ``every_s`` seconds instead, the first after
    ``every_s`` (a 2,048-GPU MoE search plans thousands of candidates for many minutes). Use as
    a context manager.

    >>> import io
    >>> out, now = io.StringIO(), [0.0]
    >>> bar = ProgressBar(console=Console(file=out, width=80), every_s=60.0)
    >>> bar.clock = lambda: now[0]
    >>> with bar:
    ...     for t, label, done, total in ((30.0, "ranking", 4, 5), (61.0, "ranking", 4, 4), (90.0, "ranking", 12, 13),
    ...                                   (125.0, "near the memory limit", 16, 32)):
    ...         now[0] = t
    ...         bar(label, done, total)
    >>> print(out.getvalue(), end="")
    search: ranking, 4 exact plans, 61 s
    search: near the memory limit, 16 of 32 exact plans, 125 s

    The ranking's count is the largest a label was given (its rounds report their own counts, its
    queue the running total, whose total is unknown: one more while the queue holds any).
    """

    def __init__(self, after_s: float = 0.5, console: Console | None = None, every_s: float = LINE_EVERY_S):
        self.clock, self.after_s, self.every_s = time.perf_counter, after_s, every_s
        self.console = console or Console(stderr=True)
        self.t0 = self.clock()
        self.last = self.t0
        self.bar: Progress | None = None
        self.tasks: dict[str, TaskID] = {}
        self.most: dict[str, int] = {}

    def __enter__(self) -> "ProgressBar":
        self.t0 = self.last = self.clock()
        return self

    def __call__(self, label: str, done: int, total: int) -> None:
        if not self.console.is_terminal:
            now, most = self.clock(), max(done, self.most.get(label, 0))
            self.most[label] = most
            if now - self.last >= self.every_s:
                self.last = now
                of = f" of {total:,}" if total > most + 1 else ""
                self.console.file.write(f"search: {label}, {most:,}{of} exact plans, {now - self.t0:.0f} s\n")
                self.console.file.flush()
            return
        if self.bar is None:
            if self.clock() - self.t0 < self.after_s:
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
