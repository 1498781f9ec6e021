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
from typing import Any

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
        self.description = description
        self.total = total
        self.progress: Any = None
        self.thread: threading.Thread | None = None
        self.done = threading.Event()
        self.start: int | None = None

    def __enter__(self) -> "Bar":
        stream = sys.stderr
        isatty = getattr(stream, "isatty", None)
        if not (isatty is not None and isatty()) or jax.process_index() != 0:
            return self
        try:
            import rich.console
            import rich.progress as rp
        except ImportError:
            return self
        self.start = _bytes_read()
        console = rich.console.Console(file=stream, force_terminal=True)
        self.progress = rp.Progress(
            rp.TextColumn("{task.description}"),
            rp.BarColumn(bar_width=30),
            rp.DownloadColumn() if self._counted() else rp.TextColumn(""),
            rp.TimeElapsedColumn(),
            console=console,
            auto_refresh=False,
        )
        self.task = self.progress.add_task(self.description, total=self._total())
        if DELAY_SECONDS <= 0:
            self._show()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _counted(self) -> bool:
        return self.total is not None and self.start is not None

    def _total(self) -> int | None:
        return self.total if self._counted() else None

    def _show(self) -> None:
        if not self.progress.live.is_started:
            self.progress.start()
        self._update()

    def _update(self, finished: bool = False) -> None:
        now, start, total = _bytes_read(), self.start, self.total
        if now is not None and start is not None and total is not None:
            read = total if finished else min(now - start, total)
            self.progress.update(self.task, completed=read)
        self.progress.refresh()

    def _run(self) -> None:
        if self.done.wait(max(DELAY_SECONDS, 0)):
            return
        self._show()
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
