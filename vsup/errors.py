"""Errors the CLI prints as one line on stderr, with their exit status."""


class UsageError(Exception):
    """A bad flag or argument; the message names it and says how to fix it. Exit 2."""

    exit_code = 2


class Failure(Exception):
    """Something failed that no flag can fix now (a helper process that died, say); the message says what. Exit 1."""

    exit_code = 1
