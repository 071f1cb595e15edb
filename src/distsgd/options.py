"""Settings declared once, as typed dataclass fields carrying their help: the run's common settings
(:class:`distsgd.config.RunConfig`) and each algorithm's own options (a subclass of
:class:`Options` that the algorithm declares).

From these declarations come the command line's flags and ``--help``, the TOML keys, the keywords
of ``distsgd.train`` and bench's ``NAME[key=value]``: a value from any of them is checked against
the field's type here (:func:`coerce`), then by the options' own :meth:`Options.check`.

A field's metadata (set by :func:`option`): ``help`` (what it is, without its default: ``--help``
adds that, :func:`help_text`); ``flag`` (when not ``--`` plus its name); ``const`` (the flag's
value is optional, and the flag alone means ``const``); ``metavar``; ``parse`` (a string or number
as given -> the field's value, raising ``ConfigError``) and ``show`` (the value -> what a TOML file
holds), for fields whose type is not a plain one; ``unset`` (what a setting left unset, None,
becomes when the run is settled, unless the model or the algorithm has its own); ``default``
(how ``--help`` words a default its value alone does not say); ``check`` (the field's own check).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Callable, ClassVar, TypeVar

from distsgd.errors import ConfigError

if TYPE_CHECKING:
    from distsgd.config import RunConfig

T = TypeVar("T", bound="Options")
V = TypeVar("V")


def option(
    default: V,
    help: str,
    *,
    flag: str | None = None,
    const: V | None = None,
    metavar: str | None = None,
    parse: Callable[[str | int | float], V] | None = None,
    show: Callable[[V], object] | None = None,
    unset: object = None,
    default_help: str | None = None,
    check: Callable[[str, Any], str | None] | None = None,
) -> V:
    """A setting: its default and help text (``--help``), and how to read it (see the module). Typed
    as its value, which is what the dataclass field holds. ``check(flag, value)``: what is wrong
    with a value that is not None, in one line, or None."""
    metadata = {"help": help, "flag": flag, "const": const, "metavar": metavar, "parse": parse, "show": show}
    return field(default=default, metadata={**metadata, "unset": unset, "default": default_help, "check": check})


def default_of(f: dataclasses.Field) -> Any:
    """The value a field takes when it is not given, as a TOML file holds it (its ``unset`` value
    for a setting whose default is settled with the run)."""
    given = f.metadata.get("unset")
    return shown(f, f.default if given is None else given)


def default_words(f: dataclasses.Field) -> str | None:
    """How ``--help`` names the field's default: its value, or its ``default`` wording; None for an
    off switch or a setting that is off unless given."""
    wording, default = f.metadata.get("default"), default_of(f)
    if wording is not None:
        return wording.format(default=default)
    return None if default is None or default is False else str(default)


def help_text(f: dataclasses.Field, help: str | None = None) -> str:
    """The field's help (or ``help``, made elsewhere), with its default (:func:`default_words`)."""
    words = default_words(f)
    return (help or f.metadata.get("help", "")) + ("" if words is None else f"; default {words}")


def check_value(f: dataclasses.Field, value: Any) -> None:
    """A ``ConfigError`` when ``value`` fails the field's own check."""
    judge = f.metadata.get("check")
    wrong = judge(flag_of(f), value) if judge is not None and value is not None else None
    if wrong is not None:
        raise ConfigError(wrong)


def at_least(low: int, unit: str = "") -> Callable[[str, Any], str | None]:
    """A check: a whole number of at least ``low`` (``unit``: what it counts, for the message)."""
    return lambda flag, v: None if v >= low else f"{flag} must be at least {low}{unit}, got {v}"


def not_negative(flag: str, value: float) -> str | None:
    return None if value >= 0 else f"{flag} must be >= 0, got {value}"


def names_of(choices: tuple[str, ...]) -> Callable[[str, Any], str | None]:
    """A check: comma-separated names, each one of ``choices``."""
    return lambda flag, v: next(
        (
            f"unknown {flag} '{n}' (choose from {', '.join(choices)}, comma-separated)"
            for n in v.split(",")
            if n not in choices
        ),
        None,
    )


def one_of(choices: tuple[str, ...], what: str) -> Callable[[str, Any], str | None]:
    """A check: one of ``choices`` (``what``: the setting's name in the message)."""
    # (repr: a value with a newline or a control character stays on the error's one line)
    return lambda flag, v: None if v in choices else f"unknown {what} {str(v)!r} (choose from {', '.join(choices)})"


def kind(f: dataclasses.Field) -> str:
    """A field's plain type for reading values: 'bool', 'int', 'float', 'str' or 'other'."""
    annotation = str(f.type)
    if f.metadata.get("parse") is not None:
        return "str"  # read from what was given, by its parse
    for name in ("bool", "float", "int", "str"):
        if name in annotation.replace("None", ""):
            return "float" if name == "int" and "float" in annotation else name
    return "other"


def optional(f: dataclasses.Field) -> bool:
    return "None" in str(f.type)


def coerce(f: dataclasses.Field, value: Any) -> Any:
    """``value`` (from a TOML file, ``distsgd.train``, a flag or a bench spec) as field ``f`` takes
    it; a ``ConfigError`` naming the setting when it cannot."""
    name, const, parse = f.name, f.metadata.get("const"), f.metadata.get("parse")
    if const is not None and isinstance(value, bool):  # an optional-value flag: True means its const
        return const if value else None
    if value is None:
        if optional(f):
            return None
        raise ConfigError(f"setting '{name}' cannot be empty")
    if parse is not None:
        if isinstance(value, bool) or not isinstance(value, (str, int, float, os.PathLike)):
            raise ConfigError(f"setting '{name}' must be a string or a number, got {value!r}")
        return parse(str(value) if not isinstance(value, (int, float)) else value)
    k = kind(f)
    if k == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"setting '{name}' must be true or false, got {value!r}")
        return value
    if k == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"setting '{name}' must be a whole number, got {value!r}")
        return value
    if k == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"setting '{name}' must be a number, got {value!r}")
        return float(value)
    if k == "str":
        if not isinstance(value, (str, os.PathLike)):
            raise ConfigError(f"setting '{name}' must be a string, got {value!r}")
        return str(value)
    return value


def shown(f: dataclasses.Field, value: Any) -> Any:
    """What a TOML file holds for ``value`` of field ``f``."""
    show = f.metadata.get("show")
    return show(value) if show is not None and value is not None else value


def close_match(name: str, candidates: list[str]) -> str | None:
    found = difflib.get_close_matches(name, candidates, n=1, cutoff=0.7)
    return found[0] if found else None


@dataclass(frozen=True)
class Options:
    """An algorithm's own options: subclass it as a frozen dataclass of :func:`option` fields and
    give it a :meth:`check`. The values travel in ``RunConfig.options`` as a plain mapping (what
    the user gave, then, once the run is settled, every option with its default filled in)."""

    owner: ClassVar[str] = ""  # the algorithm's name, for messages

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_mapping(cls: type[T], values: dict[str, Any]) -> T:
        """The options from ``values`` (keys with ``-`` or ``_``; missing ones take their defaults)."""
        by_name = {f.name: f for f in fields(cls)}
        changes = {}
        for key, value in values.items():
            name = key.replace("-", "_")
            if name not in by_name:
                raise ConfigError(f"{cls.owner or cls.__name__} has no option '{key}'")
            changes[name] = coerce(by_name[name], value)
        return cls(**changes)

    @classmethod
    def pick(cls: type[T], values: dict[str, Any]) -> T:
        """The options from those of ``values`` this class declares (the rest ignored): for a part
        of an algorithm that reads a base class's options from a subclass's mapping."""
        names = set(cls.names())
        return cls.from_mapping({k: v for k, v in values.items() if k.replace("-", "_") in names})

    def to_mapping(self) -> dict[str, Any]:
        """Every option, as a TOML file or ``RunConfig.options`` holds it."""
        return {f.name: shown(f, getattr(self, f.name)) for f in fields(self)}

    def check(self, cfg: RunConfig) -> None:
        """Reject option values this algorithm cannot honour with these common settings ``cfg``."""


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


__all__ = [
    "option",
    "Options",
    "coerce",
    "shown",
    "kind",
    "optional",
    "close_match",
    "flag_of",
    "default_of",
    "default_words",
    "help_text",
    "check_value",
    "at_least",
    "not_negative",
    "one_of",
]
