"""The one exception users see: a message that names the file, row or key and says what to do; and how a time
limit's stop reaches a stage (as Ctrl-C does)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


def brief(e: BaseException, limit: int = 160) -> str:
    """``Type: first line`` of an exception, for the one-line note eyas prints when it goes on without what failed
    (a compiler, a kernel)."""
    text = str(e)
    return f"{type(e).__name__}: {text.splitlines()[0][:limit] if text else ''}"


class EyasError(Exception):
    """A problem with the user's input or environment.

    The CLI prints these without a traceback; anything else is a bug in eyas.
    """


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Inside the block a SIGTERM (a time limit: `timeout`, a batch scheduler) raises ``KeyboardInterrupt`` as
    Ctrl-C does, so a stage closes its journal and checkpoints properly and the rerun resumes. Only in the main
    thread (elsewhere signals cannot be handled); the previous handler is back after the block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
