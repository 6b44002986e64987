"""The one exception users see: a message that names the file, row or key and says what to do."""


class EyasError(Exception):
    """A problem with the user's input or environment.

    The CLI prints these without a traceback; anything else is a bug in eyas.
    """
