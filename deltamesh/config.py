"""The one config loader: typed dataclass configs from a TOML file plus command-line overrides.

Every service describes its settings as a dataclass with defaults (nested dataclasses for sections)
and validates them in `__post_init__`. Each process reads one table of a config file (`[pool]`,
`[gateway]`, `[broker]`, `[trainer]`, `[autoscale]`, `[demo]`). `load_config` reads an optional TOML
file, takes that table, applies overrides (usually the flags that were given, see
`deltamesh.config_flags`), checks types and unknown keys, and builds the dataclass, so a typo in a
config file is an error rather than a silently ignored setting; a file written for an older layout
fails naming where its keys moved (`deltamesh.config_moved`). Checks that many configs make
(`http_url`, `http_urls`) live here too, so that they read and fail alike.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from pathlib import Path
from typing import Any, Mapping, TypeVar

from deltamesh.config_moved import moved_keys_in

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or override that does not fit the config's schema."""


def load_config(
    cls: type[T],
    path: str | Path | None = None,
    *,
    section: str | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> T:
    """Build `cls` from the TOML file at `path` (its table `section` if given) and `overrides`.

    Overrides whose value is None are ignored, so argparse results can be passed as they are.
    Dotted override keys ("relay.connections") reach into nested sections. Keys of an older layout
    (in the file or the overrides) fail with a message naming where they moved.
    """
    data: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"cannot read config {path}: {e}") from e
    table = data
    if section is not None:
        table = data.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"config {path}: [{section}] must be a table")
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        node = table
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{section or cls.__name__}: {key}: {p} is not a table")
        node[leaf] = value
    if section is not None:
        moved = moved_keys_in(data, section)
        if moved:
            source = f"config {path}" if path is not None else f"[{section}]"
            raise ConfigError(f"{source} uses an older layout: {'; '.join(moved)} (see docs/CONFIG.md)")
    return from_dict(cls, table, where=section or cls.__name__)


def from_dict(cls: type[T], data: Mapping[str, Any], *, where: str = "config") -> T:
    """Build dataclass `cls` from a plain mapping, checking keys and value types."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a table, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = set(data) - set(fields)
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}; known: {sorted(fields)}")
    kwargs = {name: _convert(hints[name], value, f"{where}.{name}") for name, value in data.items()}
    for name, f in fields.items():
        # A required section left out is built from an empty table, so that what it lacks is
        # reported under its own name ("pool.sync: gateways must ...").
        if name not in kwargs and _required(f) and dataclasses.is_dataclass(hints[name]):
            kwargs[name] = from_dict(hints[name], {}, where=f"{where}.{name}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from e


def http_url(value: str, what: str) -> str:
    """`value` without its trailing slash, if it is an http(s) URL; else ValueError naming `what`.

    For the configs' `__post_init__` checks (`from_dict` reports their ValueErrors as ConfigError).
    """
    if not value.startswith(("http://", "https://")):
        raise ValueError(f"{what} must be an http(s) URL, got {value!r}")
    return value.rstrip("/")


def split_urls(value: str | typing.Sequence[str]) -> list[str]:
    """The URLs of a comma-separated string (or a sequence), each without its trailing slash, in
    order and once each; blanks are dropped."""
    items = value.split(",") if isinstance(value, str) else list(value)
    urls: list[str] = []
    for item in items:
        url = item.strip().rstrip("/")
        if url and url not in urls:
            urls.append(url)
    return urls


def http_urls(value: str, what: str) -> str:
    """`value`, one or more http(s) URLs separated by commas ("http://a:8700,http://b:8700"), as
    `split_urls` normalises them, joined by commas again; ValueError naming `what` if it holds none
    or one is not an http(s) URL."""
    urls = [http_url(url, what) for url in split_urls(value)]
    if not urls:
        raise ValueError(f"{what} must be one or more http(s) URLs separated by commas, got {value!r}")
    return ",".join(urls)


def to_dict(config: Any) -> dict[str, Any]:
    """The plain-data form of a config (for logs, reports and child processes' config files)."""
    return dataclasses.asdict(config)


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _convert(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{where}: {value!r} fits none of {tp}: {'; '.join(errors)}")
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not one of {list(args)}")
        return value
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where=where)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            return tuple(_convert(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
        item = args[0] if args else Any
        items = [_convert(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a table, got {value!r}")
        vt = args[1] if args else Any
        return {str(k): _convert(vt, v, f"{where}.{k}") for k, v in value.items()}
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is Path and isinstance(value, str):
        return Path(value)
    if isinstance(tp, type):
        if tp is int and isinstance(value, bool):
            raise ConfigError(f"{where}: expected int, got bool")
        if not isinstance(value, tp):
            raise ConfigError(f"{where}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
        return value
    return value
