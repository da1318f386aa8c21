"""Frozen-dataclass schema helpers: build a dataclass from a YAML mapping, reject unknown keys,
check types and ranges, and name the offending field (``costs.model.target.weight_ms``) on error.

Every number is finite (``.inf`` and ``.nan`` are refused where a number is read), every mapping
key is a string, and a file is read only up to ``MAX_FILE_BYTES``, as UTF-8, without recursion
deeper than the interpreter allows: whatever the bytes, reading a table returns a table or raises
:class:`TableError` naming the file (and the field).

Only the standard library and yaml are used: the runtime must stay light.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import types
import typing
from collections.abc import Hashable
from typing import Any, Literal, TypeVar, Union, cast, get_args, get_origin

import yaml

from spectune.errors import TableError

T = TypeVar("T")

_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
# a profile of the largest study is ~1 MiB; a file past this is not a table (e.g. /dev/zero)
MAX_FILE_BYTES = 16 * 1024 * 1024
# flow collections ([..], {..}) nested deeper than this are not a table (a table nests ~6 deep);
# refused before parsing: libyaml's own limit is not in every build (PyYAML 6.0.3's parsed 5 000
# levels here), and the constructors recurse
MAX_FLOW_NESTING = 200
_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _convert(tp: Any, value: Any, path: str) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise TableError(path, "must not be null")
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return _convert(options[0], value, path)  # keeps the inner field's path
        errors: list[TableError] = []
        for arg in options:
            try:
                return _convert(arg, value, path)
            except TableError as exc:
                errors.append(exc)
        deeper = [e for e in errors if e.field != path]
        if deeper:
            raise deeper[0]
        raise TableError(path, " or ".join(e.reason for e in errors))
    if origin is Literal:
        choices = get_args(tp)
        if not isinstance(value, str | int | float) or value not in choices:
            raise TableError(path, f"must be one of {', '.join(map(repr, choices))}, got {_short(value)}")
        return value
    if value is None:
        raise TableError(path, "must not be null")
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return from_dict(tp, value, path)
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise TableError(path, f"must be a list, got {type(value).__name__}")
        args = get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise TableError(path, f"must have {len(args)} items, got {len(value)}")
            return tuple(_convert(a, v, _join(path, i)) for i, (a, v) in enumerate(zip(args, value, strict=True)))
        elem = args[0] if args else Any
        items = [_convert(elem, v, _join(path, i)) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise TableError(path, f"must be a mapping, got {type(value).__name__}")
        kt, vt = get_args(tp) or (Any, Any)
        _check_keys(value, path)
        return {_convert(kt, k, _join(path, str(k))): _convert(vt, v, _join(path, str(k))) for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise TableError(path, f"must be true or false, got {_short(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TableError(path, f"must be an integer, got {_short(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TableError(path, f"must be a number, got {_short(value)}")
        try:
            number = float(value)
        except OverflowError:
            raise TableError(path, "must be a finite number, got an integer too large for a float") from None
        if not math.isfinite(number):
            raise TableError(path, f"must be a finite number, got {value!r}")
        return number
    if tp is str:
        if not isinstance(value, str | int | float) or isinstance(value, bool):
            raise TableError(path, f"must be a string, got {_short(value)}")
        return str(value)
    raise TypeError(f"unsupported schema type {tp!r} at {path}")


def from_dict(cls: type[T], data: Any, path: str = "") -> T:
    """Build dataclass ``cls`` from a mapping; unknown or missing keys raise :class:`TableError`.

    After construction, a ``validate(self, path)`` method on the class (if any) runs range checks.
    """
    if not isinstance(data, dict):
        raise TableError(path, f"must be a mapping, got {type(data).__name__}")
    _check_keys(data, path)
    hints = _hints(cast(Hashable, cls))
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    retired = getattr(cls, "RETIRED_KEYS", {})  # keys of older schema versions -> what to do
    for key in unknown:
        if key in retired:
            raise TableError(_join(path, key), retired[key])
    if unknown:
        raise TableError(_join(path, unknown[0]), f"unknown key (allowed: {', '.join(fields)})")
    kwargs = {}
    for name, f in fields.items():
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise TableError(_join(path, name), "missing")
            continue
        kwargs[name] = _convert(hints[name], data[name], _join(path, name))
    obj = cls(**kwargs)
    check = getattr(obj, "validate", None)
    if callable(check):
        check(path)
    return obj


@functools.cache
def _hints(cls: Any) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _check_keys(data: dict, path: str) -> None:
    for key in data:
        if not isinstance(key, str):
            raise TableError(_join(path, str(key)), f"keys must be strings, got {type(key).__name__} {_short(key)}")


def _short(value: Any, limit: int = 40) -> str:
    # a value in an error line: repr, cut so that a huge value still gives one short line
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def to_dict(obj: Any) -> Any:
    """Dataclass tree -> plain YAML-able python objects (tuples become lists)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list | tuple):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def require(cond: bool, path: str, reason: str) -> None:
    if not cond:
        raise TableError(path, reason)


def read_yaml(path: str | os.PathLike[str]) -> Any:
    """The YAML document in ``path``: at most MAX_FILE_BYTES of UTF-8 text; TableError otherwise."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise TableError("", f"cannot read: {exc.strerror or exc}", path) from None
    if len(data) > MAX_FILE_BYTES:
        raise TableError("", f"larger than {MAX_FILE_BYTES // 2**20} MiB: not a spectune table", path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TableError("", f"not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})", path) from None
    return parse_yaml(text, path)


def parse_yaml(text: str, file: str | os.PathLike[str] | None = None) -> Any:
    """``yaml.safe_load`` whose every failure is one TableError (naming ``file``). libyaml's
    loader when present (~10x faster); flow collections nested deeper than ``MAX_FLOW_NESTING``
    are refused first (brackets inside quoted strings count too; a table's strings do not open 200)."""
    depth = 0
    for c in _NOT_BRACKETS.sub("", text):
        depth += 1 if c in "[{" else -1
        if depth > MAX_FLOW_NESTING:
            raise TableError("", f"not a spectune table: nested deeper than {MAX_FLOW_NESTING} levels", file)
    try:
        return yaml.load(text, Loader=_SAFE_LOADER)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise TableError("", f"not valid YAML{where}", file) from None
    except RecursionError:
        raise TableError("", "not a spectune table: nested too deeply", file) from None
    except (ValueError, TypeError, OverflowError) as exc:  # e.g. a timestamp with month 13
        raise TableError("", f"not valid YAML: {_short(str(exc), 80)}", file) from None


def dump_yaml(data: Any) -> str:
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=100)
