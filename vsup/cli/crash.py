"""What an unexpected exception becomes at the command line: one line that names it and the file holding its
traceback (a crash-*.log in the run dir's logs/ once a command knows its run dir, else a vsup-*.log temp
file), and exit status 1. A person never sees a raw traceback; VSUP_DEBUG=1 prints it as well."""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

try:  # typer vendors click from 0.20 on
    from typer._click.globals import get_current_context
except ImportError:  # pragma: no cover
    from click.globals import get_current_context

DEBUG = "VSUP_DEBUG"
LOG_DIR = "log_dir"  # the key in the CLI's state (main.execute's ctx.obj)


def remember(run_dir) -> None:
    """From here on, a crash of this command writes its traceback into `run_dir`'s logs/."""
    ctx = get_current_context(silent=True)
    if ctx is not None and isinstance(ctx.obj, dict):
        ctx.obj[LOG_DIR] = run_dir.log_dir


def report(command: str, error: BaseException, log_dir: Path | None = None) -> str:
    """Save the traceback of `error`; the one line to print for it."""
    text = "".join(traceback.format_exception(error))
    saved_in = save(text, log_dir)
    if os.environ.get(DEBUG) == "1":
        sys.stderr.write(text)
    summary = " ".join(str(error).split())[:300]
    what = f"{type(error).__name__}: {summary}" if summary else type(error).__name__
    where = f"traceback in {saved_in}; {DEBUG}=1 shows it" if saved_in else f"{DEBUG}=1 shows the traceback"
    return f"{command}: internal error: {what} ({where})"


def save(text: str, log_dir: Path | None) -> str | None:
    """The path of a new file holding `text`: in `log_dir` when it takes one, else in the temp dir; None when
    neither does."""
    import tempfile  # (only on a crash: every command imports this module)

    for directory, prefix in ((log_dir, "crash-"), (None, "vsup-")):
        if prefix == "crash-" and log_dir is None:
            continue
        try:
            fd, path = tempfile.mkstemp(prefix=prefix, suffix=".log", dir=directory)
        except OSError:
            continue
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return path
    return None
