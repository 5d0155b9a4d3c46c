"""Command-line flags derived from the config dataclasses, so that each setting is declared once.

`add_config_flags(parser, Config, section="pool")` adds one flag per setting of a config dataclass,
nested sections included; `config_overrides(args, Config)` turns the parsed namespace into the dotted
overrides `deltamesh.config.load_config` takes (flags not given are left out, so the file or the
default stands).

Naming: a setting's flag is its dotted path in the table with "_" written "-": `max_episodes` is
`--max-episodes`, `stall_timeout_s` of the section `sync` is `--sync.stall-timeout-s`. Types come from
the annotations: bool gives `--x` / `--no-x`; a list takes the flag once per item; a fixed-length tuple
takes that many values; a Literal gives the choices; `X | None` takes an X (None stays the default); a
dict of str takes `KEY=VALUE` once per entry; any other dict one JSON object. A list of tables
(`[[pool.models]]`) has no flag: it is written in the file (or made by a command's own shorthand).
Help is the field's attribute docstring (the string literal written under the field in the class
body), with the dataclass's default appended. A field may declare short aliases (`--gateway` for
`--sync.gateways`) and a metavar in its metadata with `flag(...)`; an alias holds wherever the
field's section is nested.

Secrets: a field declared with `flag(secret_env="DELTAMESH_TOKEN")` (a token) never travels on the
command line, where other users of the host see it (`ps`): it comes from `--token-file PATH` (the first
line of a file) or, when that is not given, the environment variable named (which then overrides the
config file too). Its own flag (`--token`) is kept only to refuse it with a message naming those two,
and is left out of `--help`. docs/CONFIG.md, "Secrets".
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import logging
import os
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

ALIASES = "aliases"
METAVAR = "metavar"
SECRET_ENV = "secret_env"
_DEST = "setting:"  # namespace attributes of derived flags; no hand-written flag's dest looks like this


def flag(*aliases: str, metavar: str | None = None, secret_env: str | None = None) -> dict[str, Any]:
    """Field metadata naming a setting's short aliases and metavar:
    `gateways: list[str] = field(default_factory=list, metadata=flag("--gateway", metavar="URL"))`;
    `secret_env` makes it a secret, also read from a file (`--X-file`) or that environment variable."""
    for alias in aliases:
        if not alias.startswith("--") or "_" in alias:
            raise ValueError(f"alias {alias!r} must be a long option written with dashes")
    meta: dict[str, Any] = {ALIASES: tuple(aliases)}
    if metavar:
        meta[METAVAR] = metavar
    if secret_env:
        meta[SECRET_ENV] = secret_env
    return meta


def flag_name(path: str) -> str:
    """The flag of the setting at dotted `path`: "sync.stall_timeout_s" -> "--sync.stall-timeout-s"."""
    return "--" + path.replace("_", "-")


@dataclasses.dataclass(frozen=True)
class Setting:
    """One flag-bearing setting of a config: its dotted path, its field and its argparse options."""

    path: str
    field: dataclasses.Field
    options: dict[str, Any]
    finish: Callable[[Any], Any]
    """Turns the parsed value into the override (KEY=VALUE pairs into a dict, ...)."""
    from_file: bool = False
    """The `--X-file PATH` flag of a secret setting, rather than its own flag."""

    @property
    def flags(self) -> list[str]:
        name = flag_name(self.path)
        names = [name, *(a for a in self.field.metadata.get(ALIASES, ()) if a != name)]
        return [f"{n}-file" for n in names] if self.from_file else names

    @property
    def dest(self) -> str:
        return _DEST + self.path + ("-file" if self.from_file else "")


def settings(cls: type) -> Iterator[tuple[str, type, list[Setting]]]:
    """Each section of config `cls` (its own fields first, then its nested sections, depth first) as
    (dotted prefix, section class, the section's flag-bearing settings)."""
    yield from _sections(cls, "")


def field_docs(cls: type) -> tuple[str, dict[str, str]]:
    """The docstring of dataclass `cls` and of each field (the string written under it), from the
    source of `cls` and its dataclass bases; whitespace is folded. Empty where there is no source."""
    class_doc, docs = "", {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue  # a class without source (built at run time): its flags go without help
        node = tree.body[0]
        if not isinstance(node, ast.ClassDef):
            continue
        class_doc = " ".join((ast.get_docstring(node) or "").split())
        for stmt, after in zip(node.body, node.body[1:]):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                docs[stmt.target.id] = " ".join(after.value.value.split())
    return class_doc, docs


def add_config_flags(parser: argparse.ArgumentParser, cls: type, *, section: str | None = None) -> None:
    """Add a flag for every setting of config dataclass `cls` to `parser`, one argument group per
    section; `section` is the table the command reads, which titles the groups ("[pool.sync]")."""
    for prefix, sub, found in settings(cls):
        if not found:
            continue
        path = [p for p in (section, prefix.rstrip(".")) if p]
        title = f"[{'.'.join(path)}] settings" if section else f"{'.'.join(path)} settings".lstrip()
        class_doc, docs = field_docs(sub)
        group = parser.add_argument_group(title, _first_sentence(class_doc) or None)
        for s in found:
            doc = docs.get(s.field.name, "")
            if SECRET_ENV not in s.field.metadata:
                help_text = _help(doc, s)
            else:  # a secret's own flag stays, hidden, only to be refused with a pointer to the right way
                help_text = _secret_help(doc, s) if s.from_file else argparse.SUPPRESS
            group.add_argument(*s.flags, dest=s.dest, default=None, help=help_text, **s.options)


def config_overrides(args: argparse.Namespace, cls: type, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The overrides made by the flags of `cls` that were given: dotted path -> value, and a secret
    that no flag gave from its environment variable (in `environ`, default the process's). `args` must
    come from a parser that `add_config_flags` gave the flags of `cls`. ValueError (one line) for a
    secret given on the command line itself, naming its file flag and variable, or a secret's file that
    cannot be read."""
    given = vars(args)
    environ = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for _, _, found in settings(cls):
        for s in found:
            value = given[s.dest]
            if value is None:
                continue
            if SECRET_ENV in s.field.metadata and not s.from_file:
                raise ValueError(secret_on_command_line(s))
            out[s.path] = read_secret(value, s.flags[0]) if s.from_file else s.finish(value)
        for s in found:
            env = s.field.metadata.get(SECRET_ENV)
            if env and s.path not in out and environ.get(env):
                out[s.path] = environ[env]
    return out


def secret_on_command_line(s: Setting) -> str:
    """Why a secret's own flag is refused, and what to give instead."""
    return (f"{s.flags[0]} would show the token to every user of this host (ps): put it in a file only "
            f"you can read and give {s.flags[0]}-file PATH, or set ${s.field.metadata[SECRET_ENV]}")


def read_secret(path: str, what: str) -> str:
    """The secret in the file at `path` (its first line, without surrounding blanks), for the flag
    `what`; ValueError naming both when it cannot be read or holds nothing. A file that others may
    read is used, with a warning: the secret is only as private as the file."""
    try:
        with open(path, encoding="utf-8") as f:
            secret = f.readline().strip()
            mode = os.fstat(f.fileno()).st_mode
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{what} {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    if not secret:
        raise ValueError(f"{what} {path}: the file is empty")
    if mode & 0o077:
        logging.getLogger(__name__).warning("%s %s: others may read it (chmod 600 it)", what, path)
    return secret


def _sections(cls: type, prefix: str) -> Iterator[tuple[str, type, list[Setting]]]:
    hints = typing.get_type_hints(cls)
    own: list[Setting] = []
    nested: list[tuple[str, type]] = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp = hints[f.name]
        section = _section_type(tp)
        if section is not None:
            nested.append((f"{prefix}{f.name}.", section))
            continue
        spec = _spec(tp, f, f"{cls.__name__}.{f.name}")
        if spec is not None:
            options, finish = spec
            own.append(Setting(prefix + f.name, f, options, finish))
            if SECRET_ENV in f.metadata:
                own.append(Setting(prefix + f.name, f, {"metavar": "PATH"}, _same, from_file=True))
    yield prefix, cls, own
    for sub_prefix, sub in nested:
        yield from _sections(sub, sub_prefix)


def _section_type(tp: Any) -> type | None:
    """The dataclass of a nested section (`Sub` or `Sub | None`), else None."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = rest[0] if len(rest) == 1 else None
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def _same(value: Any) -> Any:
    return value


def _spec(tp: Any, f: dataclasses.Field, where: str) -> tuple[dict[str, Any], Callable[[Any], Any]] | None:
    """argparse options and the finishing step for a field of annotation `tp`; None for no flag."""
    metavar = f.metadata.get(METAVAR)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"{where}: no flag for the union {tp}")
        return _spec(rest[0], f, where)
    if tp is bool:
        return {"action": argparse.BooleanOptionalAction}, _same
    if origin is typing.Literal:
        return {"choices": list(args), "type": type(args[0])}, _same
    if origin is list or (origin is tuple and len(args) == 2 and args[1] is Ellipsis):
        item = args[0] if args else str
        if dataclasses.is_dataclass(item):
            return None  # a list of tables is written in the file
        return {"action": "append", "type": _scalar(item, where), "metavar": metavar or _metavar(item)}, _same
    if origin is tuple:
        if len(set(args)) != 1:
            raise TypeError(f"{where}: no flag for the mixed tuple {tp}")
        return {"nargs": len(args), "type": _scalar(args[0], where), "metavar": metavar or _metavar(args[0])}, _same
    if origin is dict:
        if len(args) == 2 and args[1] is str:
            label = metavar or "KEY=VALUE"
            return {"action": "append", "type": _key_value(label), "metavar": label}, dict
        return {"type": _json_object, "metavar": metavar or "JSON"}, _same
    if tp is Any:
        return {"type": _json_value, "metavar": metavar or "JSON"}, _same
    return {"type": _scalar(tp, where), "metavar": metavar or _metavar(tp)}, _same


def _scalar(tp: Any, where: str) -> Callable[[str], Any]:
    if tp in (int, float, str):
        return tp
    if tp is Path:
        return str  # the loader makes the Path; overrides stay plain data
    raise TypeError(f"{where}: no flag for values of type {tp}")


def _metavar(tp: Any) -> str:
    return {int: "N", float: "X", str: "TEXT", Path: "PATH"}.get(tp, "VALUE")


def _key_value(label: str) -> Callable[[str], tuple[str, str]]:
    def parse(text: str) -> tuple[str, str]:
        key, sep, value = text.partition("=")
        if not sep or not key or not value:
            raise argparse.ArgumentTypeError(f"wants {label}, got {text!r}")
        return key, value

    return parse


def _json_object(text: str) -> dict[str, Any]:
    value = _json_value(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"wants a JSON object, got {text!r}")
    return value


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from e


def _help(doc: str, s: Setting) -> str:
    parts = [doc] if doc else []
    if s.options.get("action") == "append":
        parts.append("Repeat for more.")
    default = _default(s.field)
    if default is not None:
        parts.append(f"(default: {default})")
    return " ".join(parts).replace("%", "%%")  # argparse formats help with %


def _default(f: dataclasses.Field) -> str | None:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return None
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, str):
        return value or '""'
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value) or "none"
    if isinstance(value, dict):
        return json.dumps(value) if value else "none"
    return str(value)


def _secret_help(doc: str, s: Setting) -> str:
    """The help of a secret's file flag (`doc`: its field's): what it holds, and the other way to give it."""
    env = s.field.metadata[SECRET_ENV]
    text = (f"{doc} Read from the first line of this file (keep it private: chmod 600); without it, ${env} "
            "is read. Never on the command line, where other users of the host see it. Anyone running the "
            "command may give it.")
    return text.replace("%", "%%")


def _first_sentence(text: str) -> str:
    head, sep, _ = text.partition(". ")
    return head + "." if sep else text
