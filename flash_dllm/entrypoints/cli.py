"""``flash-dllm`` command line: builds the parser from the command modules and dispatches.

Each command lives in its own module of this package (``generate``, ``eval``, ``serve``,
``bench``) with ``add_parser(subparsers)`` and ``run(args)``; nothing here does work of its own
beyond what every command shares: the CPU thread count, and turning the failures a user can
cause into one ``error: ...`` line and an exit status (2 bad input, 1 a failure while running,
130 Ctrl-C) instead of a traceback. A usage error is two lines: the (sub-)command's short usage
and the error.

NOTE: the command modules (and with them torch) are imported when the parser is built, not when
this module is: ``--version`` answers without them.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

from flash_dllm import __version__

COMMAND_MODULES = ("generate", "eval", "serve", "bench", "quantize")      # in flash_dllm.entrypoints

_RST_LITERAL = re.compile(r"``(.+?)``")
_RST_ROLE = re.compile(r":[a-z]+:`([^`]+)`")


def plain_text(text: str | None) -> str | None:
    """Docstring markup (``literal``, :role:`name`) as plain text for ``--help``."""
    if text is None:
        return None
    return _RST_ROLE.sub(r"\1", _RST_LITERAL.sub(r"\1", text))


def _doc_summary(module) -> str | None:
    """A command module's first docstring paragraph, less its leading ``cmd``: label."""
    doc = (module.__doc__ or "").strip().split("\n\n")[0]
    doc = re.sub(r"^``[^`]+``:\s*", "", " ".join(doc.split()))
    return plain_text(doc[:1].upper() + doc[1:]) if doc else None


def _subparsers(parser: argparse.ArgumentParser):
    return [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]


def _polish_help(parser: argparse.ArgumentParser) -> None:
    """Every parser of the tree: help strings and descriptions without docstring markup; a
    sub-command without a description gets its one-line help as one."""
    parser.description = plain_text(parser.description)
    for action in parser._actions:
        action.help = plain_text(action.help)
    for sub in _subparsers(parser):
        helps = {a.dest: a.help for a in sub._choices_actions}
        for name, child in sub.choices.items():
            if child.description is None and helps.get(name):
                child.description = helps[name][:1].upper() + helps[name][1:]
            _polish_help(child)
        for a in sub._choices_actions:
            a.help = plain_text(a.help)


class Parser(argparse.ArgumentParser):
    """argparse with short usage errors: the (sub-)command's one-line usage, then the error
    (argparse prints the whole usage, 40 lines for ``generate``); an unknown flag is reported
    by the sub-command that was given it (argparse reports it from the top-level parser)."""

    _LEAF = "_flash_dllm_leaf_parser"

    def error(self, message: str):
        positionals = []
        for a in self._actions:
            if a.option_strings:
                continue
            name = "{%s} ..." % ",".join(a.choices) if isinstance(
                a, argparse._SubParsersAction) else (a.metavar or a.dest)
            positionals.append(f"[{name}]" if a.nargs in ("?", "*") else name)
        self.exit(2, f"usage: {self.prog} [options] {' '.join(positionals)}".rstrip()
                  + f"  ({self.prog} --help lists them)\n{self.prog}: error: {message}\n")

    def parse_known_args(self, args=None, namespace=None):
        ns, extras = super().parse_known_args(args, namespace)
        if not hasattr(ns, self._LEAF):         # the innermost sub-command returns first
            setattr(ns, self._LEAF, self)
        return ns, extras

    def parse_args(self, args=None, namespace=None):
        ns, extras = self.parse_known_args(args, namespace)
        leaf = getattr(ns, self._LEAF)
        delattr(ns, self._LEAF)
        if extras:
            leaf.error(f"unrecognized arguments: {' '.join(extras)}")
        return ns


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = Parser(
        prog="flash-dllm",
        description="Fast inference and serving for diffusion LLMs (LLaDA, Dream).")
    parser.add_argument("--version", action="version", version=f"flash-dllm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        command = importlib.import_module(f"flash_dllm.entrypoints.{name}")
        before = set(sub.choices)
        command.add_parser(sub)
        for name in set(sub.choices) - before:
            if sub.choices[name].description is None:
                sub.choices[name].description = _doc_summary(command)
    _polish_help(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--version"]:          # without building the parser: no torch import
        print(f"flash-dllm {__version__}")
        raise SystemExit(0)
    args = build_parser().parse_args(argv)
    from flash_dllm.entrypoints.args import CommandError, apply_threads
    try:
        if hasattr(args, "threads"):         # the commands that load a model (EngineArgs)
            apply_threads(args.threads, args.device)
        return args.func(args)
    except KeyboardInterrupt:
        print("error: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    except CommandError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError) as e:
        print(f"error: {e}", file=sys.stderr)    # bad input: flags, prompt, checkpoint folder
        return 2
    except BrokenPipeError:                      # `flash-dllm ... | head`: stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except OSError as e:                         # connection refused, permissions, disk full
        print(f"error: {e}", file=sys.stderr)
        return 1
