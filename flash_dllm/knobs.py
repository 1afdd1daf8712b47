"""Knobs: a config field declared once, with its help, range, choices and flag.

``knob(default, help, ...)`` is a ``dataclasses.field`` whose metadata says everything a front end
needs; ``knobs(cls)`` reads it back per field (type from the annotation), ``check_knobs(obj)`` is
the per-field validation every ``__post_init__`` runs (cross-field rules stay hand-written next
to it). The CLI flags (``entrypoints/args.py``) and the HTTP body fields (``server/protocol.py``)
are generated from the same records, so a new knob is one field.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import typing
from dataclasses import dataclass
from typing import Any, Iterable

_KEY = "knob"
_KINDS = (bool, int, float, str)


def knob(default: Any, help: str | None = None, *, ge: float | None = None,
         gt: float | None = None, le: float | None = None, lt: float | None = None,
         choices: Iterable | None = None, flag: str | None = None, cli: bool = True,
         http: bool = True):
    """A config field with its metadata.

    Args:
        default: the field's default.
        help: the ``--help`` text (argparse's ``%(default)s`` allowed); also the HTTP field's
            description.
        ge, gt, le, lt: inclusive / exclusive bounds of a number.
        choices: the allowed values; read at every use (a registry's live view works), never
            copied here.
        flag: the CLI flag when it is not ``--field-name``; for a bool on by default,
            ``--no-<name>`` gives a single off switch instead of ``--x / --no-x``.
        cli: whether the field gets a CLI flag.
        http: whether the field is an HTTP body field (per-request knobs).
    """
    if (ge is not None and gt is not None) or (le is not None and lt is not None):
        raise ValueError("give at most one lower bound (ge, gt) and one upper bound (le, lt)")
    meta = dict(help=help, ge=ge, gt=gt, le=le, lt=lt, choices=choices, flag=flag, cli=cli,
                http=http)
    return dataclasses.field(default=default, metadata={_KEY: meta})


@dataclass(frozen=True)
class Knob:
    """One knob of a config class: its field and what ``knob()`` recorded.

    ``type`` is ``bool``, ``int``, ``float`` or ``str`` (the annotation less None);
    ``optional``: None is a valid value (the annotation includes None).
    """

    name: str
    type: type
    optional: bool
    default: Any
    help: str | None
    ge: float | None
    gt: float | None
    le: float | None
    lt: float | None
    choices: Iterable | None
    flag: str | None
    cli: bool
    http: bool

    @property
    def flag_name(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    def help_text(self) -> str | None:
        """The help with argparse's placeholders filled in (the HTTP schema's description)."""
        if self.help is None:
            return None
        return self.help.replace("%(default)s", str(self.default)).replace("%%", "%")

    def describe(self) -> str:
        """The accepted values as an error message says them: ``an integer >= 1``, ``in (0, 1]``,
        ``one of ['a', 'b']``, ``a bool``; `` or None`` when None is one."""
        if self.choices is not None:
            what = f"one of {list(self.choices)}"
        elif self.type is bool:
            what = "a bool"
        elif self.type is str:
            what = "a string"
        else:
            lo = "[" if self.ge is not None else "(" if self.gt is not None else None
            hi = "]" if self.le is not None else ")" if self.lt is not None else None
            lo_v = self.ge if self.ge is not None else self.gt
            hi_v = self.le if self.le is not None else self.lt
            noun = "an integer" if self.type is int else "a finite number"
            if lo and hi:
                interval = f"in {lo}{_num(lo_v)}, {_num(hi_v)}{hi}"
                # two bounds make a number finite: "in (0, 1]" says it all
                what = f"an integer {interval}" if self.type is int else interval
            elif lo:
                what = f"{noun} {'>=' if lo == '[' else '>'} {_num(lo_v)}"
            elif hi:
                what = f"{noun} {'<=' if hi == ']' else '<'} {_num(hi_v)}"
            else:
                what = noun
        return what + (" or None" if self.optional else "")

    def accepts(self, value: Any) -> bool:
        """Whether ``value`` is a valid value of this knob on its own (type, range, choices)."""
        if value is None:
            return self.optional
        if self.type is bool:
            ok = isinstance(value, bool)
        elif self.type is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif self.type is float:
            ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
                  and math.isfinite(value))
        else:
            ok = isinstance(value, str)
        if not ok:
            return False
        if self.choices is not None:
            return value in self.choices
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))

    def check(self, value: Any) -> None:
        """Raise ``ValueError`` naming the field and what it accepts unless ``value`` is valid."""
        if not self.accepts(value):
            if isinstance(value, float) and not math.isfinite(value):
                # NOTE: NaN fails every comparison: "must be in (0, 1]" would be the wrong reason
                what = self.describe()
                what = what if what.startswith("a finite number") else f"a finite number {what}"
                raise ValueError(f"{self.name} must be {what}, got {value!r}")
            raise ValueError(f"{self.name} must be {self.describe()}, got {value!r}")


def _num(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


@functools.cache
def knobs(cls: type) -> tuple[Knob, ...]:
    """The knobs of the dataclass ``cls`` in field order; every field must be a ``knob()``."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        spec = f.metadata.get(_KEY)
        if spec is None:
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with knob() (its help, "
                            "range and flag)")
        args = typing.get_args(hints[f.name]) or (hints[f.name],)
        kinds = [a for a in args if a is not type(None)]
        if len(kinds) != 1 or kinds[0] not in _KINDS:
            raise TypeError(f"{cls.__name__}.{f.name}: a knob is a bool, int, float or str (or "
                            f"that | None), got {hints[f.name]}")
        out.append(Knob(f.name, kinds[0], type(None) in args, f.default, **spec))
    return tuple(out)


def knob_of(cls: type, name: str) -> Knob:
    for k in knobs(cls):
        if k.name == name:
            return k
    raise KeyError(f"{cls.__name__} has no knob {name!r}")


def check_knobs(obj: Any) -> None:
    """Check every field of the dataclass instance ``obj`` against its knob, in field order (the
    first bad field raises)."""
    for k in knobs(type(obj)):
        k.check(getattr(obj, k.name))
