"""Errors a user can cause: the CLI prints them as one line and exits 2."""


class UsageError(Exception):
    """A bad flag or argument; the message names it and says how to fix it."""

    exit_code = 2
