"""`--config FILE` for `vsup serve` and `vsup plan`: option values from a TOML or YAML file.

Keys are long option names, with dashes or underscores (`tensor-parallel-size`
or `tensor_parallel_size`); `model` is the MODEL argument. The file fills
click's default_map, so a flag and a VSUP_* variable both win over it, and it
wins over the built-in default. One file serves both commands: `plan` skips
the keys only `serve` takes, so it previews exactly what `serve` would launch.
"""

from __future__ import annotations

import re
from pathlib import Path

from vsup.errors import UsageError

try:  # typer vendors click from 0.20 on
    from typer._click.exceptions import ClickException
except ImportError:  # pragma: no cover
    from click.exceptions import ClickException

FORMATS = {".toml": "TOML", ".yaml": "YAML", ".yml": "YAML"}
NOT_KEYS = {"config", "help"}
KINDS = {"int": "integer", "integer": "integer", "float": "float", "boolean": "boolean", "choice": "choice"}


class LoadedConfig:
    """What a config file set in this run, so that a value refused later names the file it came from."""

    def __init__(self, path: str, ctx, keys: dict[str, str]) -> None:
        self.path, self.ctx = path, ctx
        self.keys = keys  # parameter name -> the key the file spelled it with

    def explain(self, message: str) -> str:
        """`message`, plus which key of which file set a value it names (when no flag or variable overrode it)."""
        blamed = []
        for param in self.ctx.command.params:
            key = self.keys.get(param.name)
            source = self.ctx.get_parameter_source(param.name) if key else None
            if source is None or source.name != "DEFAULT_MAP":
                continue
            needles = [*param.opts, *param.secondary_opts] if param.param_type_name == "option" \
                else [str(self.ctx.params.get(param.name, ""))]
            if any(n and re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", message) for n in needles):
                blamed.append(key)
        if not blamed:
            return message
        return f"{message} (set by {', '.join(blamed)} in --config {self.path})"


def load_into_context(ctx, param, value):
    """Click callback of the eager --config option: fill ctx.default_map from the file before other options."""
    if value is None or ctx.resilient_parsing:
        return value
    path = str(value)
    params = keyed_params(ctx)
    defaults: dict[str, object] = {}
    keys: dict[str, str] = {}
    for key, raw in read(path).items():
        target = params.get(str(key))
        if target is None:
            raise UsageError(f"--config {path}: unknown key {str(key)!r}{_suggest(str(key), params)}")
        if raw is None:
            continue  # YAML `key:` with no value keeps the default
        if isinstance(target, Sibling):  # an option only `serve` takes: checked, then left to it
            convert(ctx, target.param, key, raw, path)
            continue
        if target.name in keys:
            raise UsageError(f"--config {path}: {key} is given twice (also as {keys[target.name]})")
        defaults[target.name] = convert(ctx, target, key, raw, path)
        keys[target.name] = str(key)
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    if isinstance(ctx.obj, dict):  # main.run() passes one, and on an error asks it to explain()
        ctx.obj["config"] = LoadedConfig(path, ctx, keys)
    return value


def read(path: str) -> dict:
    """The file's top-level mapping; the extension picks the format."""
    kind = FORMATS.get(Path(path).suffix.lower())
    if kind is None:
        raise UsageError(f"--config {path}: the extension must be .toml, .yaml or .yml (it picks the format)")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise UsageError(f"--config {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"--config {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    data = _parse_toml(text, path) if kind == "TOML" else _parse_yaml(text, path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"--config {path}: expected a mapping of option names to values, "
                         f"not a {type(data).__name__}")
    return data


def _parse_toml(text: str, path: str):
    import tomllib

    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"--config {path}: not valid TOML: {e}") from None


def _parse_yaml(text: str, path: str):
    try:
        import yaml
    except ImportError:  # pragma: no cover - PyYAML is a dependency
        raise UsageError(f"--config {path}: reading YAML needs PyYAML: pip install pyyaml") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise UsageError(f"--config {path}: not valid YAML: {problem}{where}") from None


class Sibling:
    """A key that only another command with --config takes: checked, but not used here."""

    def __init__(self, param) -> None:
        self.param = param


def keyed_params(ctx) -> dict:
    """Every accepted key -> its parameter, or a Sibling for keys only another command with --config takes."""
    own = _keys(ctx.command)
    siblings: dict = {}
    group = ctx.parent.command if ctx.parent is not None else None
    for command in getattr(group, "commands", {}).values():
        if command is not ctx.command and any(p.name == "config" for p in command.params):
            siblings.update({key: Sibling(param) for key, param in _keys(command).items()})
    return {**siblings, **own}


def _keys(command) -> dict:
    keys = {}
    for param in command.params:
        if param.name in NOT_KEYS or not param.expose_value or getattr(param, "hidden", False):
            continue
        names = [o[2:] for o in param.opts if o.startswith("--")] if param.param_type_name == "option" \
            else [param.name]
        for name in names:
            keys[name] = keys[name.replace("-", "_")] = param
    return keys


def convert(ctx, param, key, raw, path: str):
    """`raw` as the option's type, strictly: a TOML 2.5 is not an integer, `true` is not a name, 3 is not a flag."""
    kind = KINDS.get(param.type.name, "text")
    if kind == "boolean":
        fits = isinstance(raw, (bool, str))
    else:
        fits = (isinstance(raw, (str, int, float)) and not isinstance(raw, bool)
                and not (kind == "integer" and isinstance(raw, float)))
    if not fits:
        raise UsageError(f"--config {path}: {key} must be {_wants(param)} (got {_show(raw)})")
    if kind == "text" and not isinstance(raw, str):
        raw = str(raw)
    try:
        return param.type_cast_value(ctx, raw)
    except ClickException as e:  # BadParameter: its message names the value and what is allowed
        raise UsageError(f"--config {path}: {key}: {e.message.rstrip('.')}") from None


def _wants(param) -> str:
    choices = getattr(param.type, "choices", None)
    if choices:
        return "one of " + ", ".join(str(getattr(c, "value", c)) for c in choices)
    kind = KINDS.get(param.type.name, "text")
    return {"integer": "an integer", "float": "a number", "boolean": "true or false"}.get(kind, "a string")


def _show(raw) -> str:
    import json

    try:
        return json.dumps(raw)
    except TypeError:
        return repr(raw)


def _suggest(key: str, params: dict) -> str:
    import difflib

    close = difflib.get_close_matches(key.replace("_", "-"), [k for k in params if "_" not in k], n=1)
    return f"; did you mean {close[0]!r}?" if close else " (keys are long option names, like 'tensor-parallel-size')"
