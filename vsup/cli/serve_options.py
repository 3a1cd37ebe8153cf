"""`plan` takes every option of `serve`, by construction: a user who swaps `serve` for `plan` keeps the flags.

`@with_serve_options(serve)` adds to a command each option of `serve` that it lacks, shown under a help
panel of its own (they do not change the plan), and hands them to the command as `kept` (to check as
`serve` does, and for the commands that `plan --k8s` will write).
"""

from __future__ import annotations

import copy
import functools
import inspect
import typing

KEPT = "Kept for serve (they do not change the plan)"


def _kept_annotation(annotation):
    """The same option, its help saying that it does not change the plan, under the KEPT panel."""
    kind, *infos = typing.get_args(annotation)
    moved = []
    for info in infos:
        info = copy.copy(info)
        if hasattr(info, "rich_help_panel"):
            info.rich_help_panel = KEPT
            info.help = f"[serve's: checked, kept, no change to the plan] {info.help or ''}".rstrip()
        moved.append(info)
    return typing.Annotated[(kind, *moved)]


def with_serve_options(serve_command):
    """Give the decorated command every option of `serve_command` it lacks, as `kept` (name -> value)."""
    theirs = inspect.signature(serve_command, eval_str=True).parameters

    def decorate(command):
        own = inspect.signature(command, eval_str=True)
        added = [p.replace(annotation=_kept_annotation(p.annotation), kind=inspect.Parameter.KEYWORD_ONLY)
                 for name, p in theirs.items() if name not in own.parameters and name != "ctx"]
        params = [p for p in own.parameters.values() if p.name != "kept"] + added

        @functools.wraps(command)
        def with_kept(*args, **kwargs):
            kept = {p.name: kwargs.pop(p.name) for p in added}
            return command(*args, kept=kept, **kwargs)

        with_kept.__signature__ = own.replace(parameters=params)
        with_kept.__annotations__ = {p.name: p.annotation for p in params}
        return with_kept
    return decorate
