"""A `rich` progress bar on a terminal's stderr for a restore past `DELAY_SECONDS`:
orbax reports nothing, so it counts the bytes read (Linux's `/proc/self/io`)."""

import contextlib
import sys
import threading
from importlib.util import find_spec

import jax


# Seconds a restore runs before its bar appears (the tests set 0: at once).
DELAY_SECONDS = 2.0


def _bytes_read() -> int:
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))
    except (OSError, ValueError, StopIteration):
        return 0


@contextlib.contextmanager
def bar(description: str, total: int | None):
    """Around a restore: a bar on a terminal's stderr after `DELAY_SECONDS`. `total`:
    the bytes it reads, or `None` if not known."""
    isatty = getattr(sys.stderr, "isatty", None)
    if not (isatty and isatty()) or jax.process_index() or not find_spec("rich"):
        yield
        return
    import rich.console
    import rich.progress as rp

    start = _bytes_read()
    total = total if start else None  # not counted: the bar shows that it runs

    class Progress(rp.Progress):
        def get_renderables(self):  # rich's refresh thread: the bytes read so far
            if total is not None and self.task_ids:
                read = min(_bytes_read() - start, total)
                self.update(self.task_ids[0], completed=read)
            yield from super().get_renderables()

    progress = Progress(
        rp.TextColumn("{task.description}"),
        rp.BarColumn(bar_width=30),
        rp.DownloadColumn() if total is not None else rp.TextColumn(""),
        rp.TimeElapsedColumn(),
        console=rich.console.Console(file=sys.stderr, force_terminal=True),
        refresh_per_second=10,
    )
    progress.add_task(description, total=total)
    timer = threading.Timer(DELAY_SECONDS, progress.start)
    if DELAY_SECONDS > 0:
        timer.start()
    else:
        progress.start()
    try:
        yield
        start = _bytes_read() - (total or 0)  # complete: the bar shows the total
    finally:
        timer.cancel()
        if timer.ident is not None:  # started: wait, should it be starting the bar
            timer.join()
        if progress.live.is_started:
            progress.stop()
