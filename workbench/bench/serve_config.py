"""A ``workbench serve`` configuration as data: the flags that start it, the shell command line,
and the JSON file that ``workbench serve --config FILE`` reads (``workbench tune`` writes one for
the configuration it measured best).

Options are ``{name: value}`` with the serve flag's name, ``-`` written ``_`` (its argparse
``dest``): ``{"max_num_seqs": 8, "compile": True, "offload": "host"}`` is
``--max-num-seqs 8 --compile --offload host``.  ``True`` is a bare switch, ``False`` and ``None``
leave the flag out, a list repeats the flag.  The file::

    {"workbench_serve_config": 1,
     "serve": {"model": "runs/smollm2", "max_num_seqs": 8, "window_ms": 5, "offload": "host"},
     "about": {"trace": "...", "p95_ttft_ms": 41.2}}

``about`` is free-form: what the step that chose the configuration knew (the trace, the SLO, the
measured figures); ``workbench serve`` does not read it.  Relative paths in ``serve`` (``model``)
are read from the directory ``workbench serve`` runs in, as on the command line.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from workbench.errors import ConfigError

VERSION_KEY = "workbench_serve_config"
VERSION = 1
_TOP_KEYS = (VERSION_KEY, "serve", "about")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def serve_argv(options: Mapping[str, Any]) -> list[str]:
    """The ``workbench serve`` arguments of ``options`` (``{"max_num_seqs": 8, "compile": True}`` ->
    ``["--max-num-seqs", "8", "--compile"]``), in the options' order.  A float is written without a
    needless ``.0`` (``5.0`` -> ``5``); a value that starts with ``-`` is joined to its flag
    (``--flag=-1``) so that it cannot read as a flag.  Which flags exist is the CLI's to check."""
    if not isinstance(options, Mapping):
        raise ConfigError(f"serve options must be a mapping of option names to values, got {_kind(options)}")
    argv: list[str] = []
    for key, value in options.items():
        problem = _option_problem(key, value)
        if problem:
            raise ConfigError(problem)
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
            continue
        for item in value if isinstance(value, (list, tuple)) else (value,):
            text = _text(item)
            argv += [f"{flag}={text}"] if text.startswith("-") else [flag, text]
    return argv


def serve_command(options: Mapping[str, Any], config_path: str | os.PathLike | None = None,
                  program: str = "workbench") -> str:
    """The shell command line that starts ``options``: ``workbench serve --model ... --compile``,
    quoted for a POSIX shell; with ``config_path`` (a file :func:`write_serve_config` wrote with
    these options) the short form ``workbench serve --config PATH``."""
    argv = serve_argv(options)          # checked either way: the short form names a file of these options
    if config_path is not None:
        argv = ["--config", os.fspath(config_path)]
    return shlex.join([program, "serve", *argv])


def write_serve_config(path: str | os.PathLike, options: Mapping[str, Any], about: Mapping[str, Any] | None = None
                       ) -> Path:
    """Write ``options`` (and the free-form ``about``) as a serve config file that
    ``workbench serve --config PATH`` reads; the file lands whole (a temporary file in the same
    folder, then renamed), so a reader never sees half of it."""
    path = Path(path)
    serve_argv(options)                 # what cannot be read back is refused before anything is written
    if about is not None and not isinstance(about, Mapping):
        raise ConfigError(f"{path}: 'about' must be a mapping of facts, got {_kind(about)}")
    doc = {VERSION_KEY: VERSION, "serve": {k: list(v) if isinstance(v, tuple) else v for k, v in options.items()},
           "about": dict(about or {})}
    try:
        text = json.dumps(doc, indent=2, allow_nan=False) + "\n"
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{path}: 'about' is not JSON: {e}") from None
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def read_serve_config(path: str | os.PathLike) -> dict[str, Any]:
    """The serve options of a file :func:`write_serve_config` wrote (or a person did), in the
    file's order.  Anything else is a one-line ConfigError naming the file and the key."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{path}: serve config file not found" if not p.exists()
                          else f"{path}: not a file (a serve config file is JSON)")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text (a serve config file is JSON)") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the serve config file: {e.strerror or e}") from None
    try:
        doc = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None
    except _Refused as e:
        raise ConfigError(f"{path}: {e}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: expected a JSON object {{\"{VERSION_KEY}\": {VERSION}, \"serve\": {{...}}}}, "
                          f"got {_kind(doc)}")
    if VERSION_KEY not in doc:
        raise ConfigError(f"{path}: no \"{VERSION_KEY}\" key: not a serve config file "
                          f"(expected {{\"{VERSION_KEY}\": {VERSION}, \"serve\": {{...}}}})")
    version = doc[VERSION_KEY]
    if type(version) is not int or version != VERSION:
        raise ConfigError(f"{path}: \"{VERSION_KEY}\": {json.dumps(version)} is not a version this workbench reads "
                          f"({VERSION})")
    for key in doc:
        if key not in _TOP_KEYS:
            raise ConfigError(f"{path}: unknown key {key!r} (a serve config file has {', '.join(_TOP_KEYS)})")
    if "about" in doc and doc["about"] is not None and not isinstance(doc["about"], dict):
        raise ConfigError(f"{path}: \"about\" must be an object of facts, got {_kind(doc['about'])}")
    serve = doc.get("serve")
    if not isinstance(serve, dict):
        raise ConfigError(f"{path}: \"serve\" must be an object of serve options such as {{\"max_num_seqs\": 8}}, "
                          f"got {'nothing' if 'serve' not in doc else _kind(serve)}")
    for key, value in serve.items():
        problem = _option_problem(key, value)
        if problem:
            raise ConfigError(f"{path}: {problem}")
    return serve


# ---- checks and formatting -------------------------------------------------------------------
def _option_problem(key, value) -> str | None:
    """What is wrong with one option (None: nothing), as the end of a sentence that names it."""
    if not isinstance(key, str) or not _NAME.match(key):
        hint = (f" (write {key.replace('-', '_').lstrip('_')!r} for --{key.lstrip('-')})"
                if isinstance(key, str) and _NAME.match(key.replace("-", "_").lstrip("_")) else "")
        return (f"serve key {key!r} is not an option name (letters, digits and _, such as 'max_num_seqs'){hint}"
                if isinstance(key, str) else f"serve key {key!r} is not a string")
    if value is None or isinstance(value, (bool, str)) or _number(value):
        return _finite(key, value)
    if isinstance(value, (list, tuple)):
        for item in value:
            if not (isinstance(item, str) or (_number(item))):
                return f"serve.{key}: a list holds strings or numbers (the flag repeated), got {_kind(item)} in it"
            problem = _finite(key, item)
            if problem:
                return problem
        return None
    return f"serve.{key}: expected a string, a number, true / false, null or a list, got {_kind(value)}"


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _finite(key: str, v) -> str | None:
    if isinstance(v, float) and not math.isfinite(v):
        return f"serve.{key}: {v!r} is not a finite number"
    return None


def _text(v) -> str:
    if isinstance(v, float):
        text = repr(v)
        return text[:-2] if text.endswith(".0") else text      # 5.0 -> 5; 2.5 and 1e+16 as they are
    return str(v)


def _kind(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return json.dumps(v)
    if isinstance(v, (dict, Mapping)):
        return "an object"
    if isinstance(v, (list, tuple)):
        return "a list"
    if isinstance(v, str):
        return f"the string {v!r}"
    if _number(v):
        return f"the number {v!r}"
    return f"a {type(v).__name__}"


class _Refused(ValueError):
    pass


def _no_duplicates(pairs):
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise _Refused(f"key {key!r} appears twice in one object")
        seen[key] = value
    return seen


def _no_constant(name: str):
    raise _Refused(f"{name} is not a JSON number")
