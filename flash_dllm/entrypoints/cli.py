"""``flash-dllm`` command line: builds the parser from the command modules and dispatches.

Each command lives in its own module of this package (``generate``, ``eval``, ``serve``,
``bench``) with ``add_parser(subparsers)`` and ``run(args)``; nothing here does work of its own.
"""
from __future__ import annotations

import argparse
import sys

from flash_dllm import __version__
from flash_dllm.entrypoints import bench, eval as eval_cmd, generate, serve

COMMANDS = (generate, eval_cmd, serve, bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flash-dllm",
        description="Fast inference and serving for diffusion LLMs (LLaDA, Dream).")
    parser.add_argument("--version", action="version", version=f"flash-dllm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
