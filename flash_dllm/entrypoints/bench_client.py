"""What the load-generating benchmarks (``bench serve``, ``bench multiturn``) need from a
server at a URL: fail at once, in one line, when nothing answers, or when it is lost mid-run."""
from __future__ import annotations

import argparse

from flash_dllm.entrypoints.args import CommandError

KNOBS = ("block_length", "steps", "decode", "cache", "threshold")


def add_request_knobs(p: argparse.ArgumentParser, max_tokens: int, max_tokens_help: str = ""):
    """The sampling knobs a load generator sends in each request's body (unset: the server's
    defaults); returns the argument group."""
    g = p.add_argument_group("request knobs (sent in the body; unset: the server's defaults)")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help=max_tokens_help or None)
    g.add_argument("--block-length", type=int, default=None)
    g.add_argument("--steps", type=int, default=None)
    g.add_argument("--decode", default=None)
    g.add_argument("--cache", default=None)
    g.add_argument("--threshold", type=float, default=None)
    g.add_argument("--temperature", type=float, default=0.0)
    return g


def request_knobs(a: argparse.Namespace) -> dict:
    """The knobs of ``add_request_knobs`` that were set (max_tokens and temperature aside)."""
    return {k: getattr(a, k) for k in KNOBS if getattr(a, k) is not None}


def check_server(url: str, timeout: float = 10.0) -> None:
    """Fail at once, in one line, when nothing answers at ``url`` (any HTTP answer will do)."""
    import httpx

    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--url must start with http:// or https://, got {url!r}")
    try:
        httpx.get(url.rstrip("/") + "/health", timeout=timeout)
    except httpx.HTTPError as e:
        raise CommandError(f"no server answers at {url} ({reason(e)}); start one with "
                           "'flash-dllm serve', or leave --url out to bench one in-process") \
            from None


def reason(e: Exception) -> str:
    """The innermost cause's text: 'Connection refused' rather than httpx's summary."""
    while e.__cause__ is not None or e.__context__ is not None:
        e = e.__cause__ or e.__context__
    text = getattr(e, "strerror", None) or str(e) or type(e).__name__
    return text


def run_against(url: str, run):
    """``run(url)``, with a server lost mid-run reported in one line."""
    import httpx

    try:
        return run(url)
    except httpx.HTTPError as e:
        raise CommandError(f"lost the server at {url}: {reason(e)}") from None
