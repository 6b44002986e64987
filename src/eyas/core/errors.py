"""The one exception users see: a message that names the file, row or key and says what to do."""


def brief(e: BaseException, limit: int = 160) -> str:
    """``Type: first line`` of an exception, for the one-line note eyas prints when it goes on without what failed
    (a compiler, a kernel)."""
    text = str(e)
    return f"{type(e).__name__}: {text.splitlines()[0][:limit] if text else ''}"


class EyasError(Exception):
    """A problem with the user's input or environment.

    The CLI prints these without a traceback; anything else is a bug in eyas.
    """
