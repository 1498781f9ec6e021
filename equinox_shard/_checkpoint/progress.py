"""A progress bar (by `rich`) for a restore that takes a while, on stderr where it is a
terminal: it appears once the restore has run `DELAY_SECONDS`, and nothing is printed
otherwise (no terminal, a quick restore, `rich` not installed, or a process other than
the first of a `jax.distributed` program).

orbax reads the arrays in one call and reports nothing along the way, so the bar counts
the bytes this process has read from files since the restore began (Linux's
`/proc/self/io`), against the bytes stored in the checkpoint's data files; elsewhere it
shows only that the restore is running.
"""

import sys
import threading

import jax


# Seconds a restore runs before its bar appears (the tests set 0: at once).
DELAY_SECONDS = 2.0
_REFRESH_SECONDS = 0.1


def _bytes_read() -> int | None:
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("rchar:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


class Bar:
    """`with Bar(description, total):` around a restore: a bar on stderr, once it has
    run `DELAY_SECONDS`, if stderr is a terminal. `total`: the bytes it reads from
    files, or `None` if not known."""

    def __init__(self, description: str, total: int | None):
        self.description, self.total = description, total
        self.thread: threading.Thread | None = None
        self.done = threading.Event()

    def __enter__(self) -> "Bar":
        isatty = getattr(sys.stderr, "isatty", None)
        if not (isatty is not None and isatty()) or jax.process_index() != 0:
            return self
        try:
            import rich.console
            import rich.progress as rp
        except ImportError:
            return self
        self.start = _bytes_read() or 0
        if not self.start:
            self.total = None  # not counted: the bar shows only that it runs
        console = rich.console.Console(file=sys.stderr, force_terminal=True)
        self.progress = rp.Progress(
            rp.TextColumn("{task.description}"),
            rp.BarColumn(bar_width=30),
            rp.DownloadColumn() if self.total is not None else rp.TextColumn(""),
            rp.TimeElapsedColumn(),
            console=console,
            auto_refresh=False,
        )
        self.task = self.progress.add_task(self.description, total=self.total)
        if DELAY_SECONDS <= 0:
            self.progress.start()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _update(self, finished: bool = False) -> None:
        now = _bytes_read()
        if self.total is not None and now is not None:
            read = self.total if finished else min(now - self.start, self.total)
            self.progress.update(self.task, completed=read)
        self.progress.refresh()

    def _run(self) -> None:
        if self.done.wait(max(DELAY_SECONDS, 0)):
            return
        self.progress.start()
        while not self.done.wait(_REFRESH_SECONDS):
            self._update()

    def __exit__(self, *exc) -> None:
        if self.thread is None:
            return
        self.done.set()
        self.thread.join()
        if self.progress.live.is_started:
            self._update(finished=exc[0] is None)
            self.progress.stop()
