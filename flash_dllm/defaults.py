"""Sampling defaults in layers: what a request gets for the ``SamplingParams`` knobs it leaves out.

Highest first (issue 42):

1. the request's own fields (an HTTP body's knobs, ``LLM.sampling_params(**fields)``);
2. the command's flags (``serve --decode vanilla``; for ``generate`` and ``eval`` the flags are
   the request);
3. the checkpoint's ``generation_config.json`` (``read_generation_config``: which keys count);
3b. the model's own block for a block-causal model (``block_length`` = its block size: SDAR's 4,
   LLaDA2's 32), which any other block would be refused on;
4. the recommended defaults, ``SamplingParams``' own: threshold decoding at 0.99 with the model
   family's fast cache (``cache`` None, resolved by the engine: ``Family.default_cache``).

``SamplingDefaults`` holds layers 2-3 (partial dicts of knob values, each with its source) and
builds a request's ``SamplingParams`` over them. Some knobs count per canvas, so a default
layer's value follows the request's canvas rather than fail it: a ``block_length`` the request
did not set is the largest divisor of its ``max_tokens`` up to the layers' value (else 32), and
``steps`` / ``max_verify`` from a layer below the one that set ``max_tokens`` /
``block_length`` are left to their derived defaults (a checkpoint's ``steps: 512`` was chosen for
its own 512-token canvas, not for a client's 64).
"""
from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flash_dllm.config import DEFAULT_BLOCK_LENGTH, SamplingParams
from flash_dllm.knobs import knob_of, knobs

# the exact reference sampler (LLaDA's, one token per forward, no cache): what accuracy is
# measured against (``eval --matrix``'s baseline, the docs' "exact")
EXACT_REFERENCE = {"decode": "vanilla", "cache": "none"}

log = logging.getLogger("flash_dllm")

GENERATION_CONFIG = "generation_config.json"
RECOMMENDED = "recommended"
# Hugging Face generation keys that mean one of our knobs (temperature, top_p, top_k are our
# names too); ``do_sample`` is read apart (false: greedy, whatever temperature says, as in HF)
HF_KEYS = {"max_new_tokens": "max_tokens"}
# what a default layer's knob follows: read only when the knob it depends on was set in the same
# layer or a lower one
_PER_CANVAS = {"steps": "max_tokens", "max_verify": "block_length"}


def fit_block_length(max_tokens: int, preferred: int = DEFAULT_BLOCK_LENGTH) -> int:
    """The largest divisor of ``max_tokens`` up to ``preferred``: any ``max_tokens`` works without
    the client knowing about blocks."""
    return max(d for d in range(1, min(preferred, max_tokens) + 1) if max_tokens % d == 0)


def read_generation_config(folder: str | Path) -> dict[str, Any]:
    """The sampling defaults a checkpoint's ``generation_config.json`` sets, by knob name.

    Read: every ``SamplingParams`` knob by its own name (``decode``, ``cache``, ``threshold``,
    ``block_length``, ``max_tokens``, ``steps``, ``temperature``, ``top_p``, ``top_k``, ``seed``,
    ...), ``max_new_tokens`` as ``max_tokens``, and ``do_sample`` (false: ``temperature`` 0;
    true without a temperature: 1.0, Hugging Face's default). Other keys (token ids,
    ``transformers_version``, another engine's ``alg``) are ignored with a debug log. A value a
    knob refuses, or invalid JSON, is a ``ValueError`` naming the file and the key. No file:
    no defaults."""
    path = Path(folder) / GENERATION_CONFIG
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    names = {k.name for k in knobs(SamplingParams)}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = HF_KEYS.get(key, key)
        if key == "do_sample" or name not in names:
            if key != "do_sample":
                log.debug("%s: key %r is not a sampling default flash-dllm reads; ignored",
                          path, key)
            continue
        if name in out:
            raise ValueError(f"{path}: {key!r} and {name!r} both set {name}; keep one")
        try:
            knob_of(SamplingParams, name).check(value)
        except ValueError as e:
            raise ValueError(f"{path}: key {key!r}: {e}") from None
        out[name] = value
    if "do_sample" in raw:
        sample = raw["do_sample"]
        if not isinstance(sample, bool):
            raise ValueError(f"{path}: key 'do_sample' must be true or false, got {sample!r}")
        if not sample:
            out["temperature"] = 0.0
        else:
            out.setdefault("temperature", 1.0)
    return out


@dataclass(frozen=True)
class SamplingDefaults:
    """The default layers below a request, highest first: ``(source, {knob: value})`` pairs,
    e.g. ``("flags", {"decode": "vanilla"})``, ``("generation_config.json", {...})``. Below
    them all: ``SamplingParams``' own defaults (the recommended ones)."""

    layers: tuple[tuple[str, dict], ...] = ()

    def __post_init__(self) -> None:
        names = {k.name for k in knobs(SamplingParams)}
        for source, values in self.layers:
            unknown = sorted(set(values) - names)
            if unknown:
                raise ValueError(f"unknown sampling parameter(s) {unknown} in {source}; "
                                 f"known: {sorted(names)}")

    @classmethod
    def of(cls, flags: dict | None = None, folder: str | Path | None = None,
           flags_source: str = "flags", model_block: int | None = None) -> SamplingDefaults:
        """The layers of a command: its ``flags`` (knobs given, None ones dropped), then the
        ``generation_config.json`` of the checkpoint ``folder``, then ``model_block``: the block
        size of a block-causal model (None: bidirectional, no layer)."""
        layers = []
        given = {k: v for k, v in (flags or {}).items() if v is not None}
        if given:
            layers.append((flags_source, given))
        if folder is not None:
            gen = read_generation_config(folder)
            if gen:
                layers.append((str(Path(folder) / GENERATION_CONFIG), gen))
        if model_block:
            layers.append((f"the model (block-causal, blocks of {model_block})",
                           {"block_length": model_block}))
        return cls(tuple(layers))

    def params(self, request: dict | None = None, cls: type = SamplingParams) -> SamplingParams:
        """``cls`` for a request that set ``request`` (knobs; None values count as not set),
        the layers filling in the rest (see the module docstring for block_length, steps and
        max_verify). Raises ``ValueError`` naming the field on a bad value or combination."""
        request = {k: v for k, v in (request or {}).items() if v is not None}
        layers = [("request", request), *self.layers]
        kw: dict[str, Any] = {}
        rank: dict[str, int] = {}                  # the layer each value came from (0: request)
        for i, (_, values) in reversed(list(enumerate(layers))):
            for k, v in values.items():
                kw[k], rank[k] = v, i
        for k, dep in _PER_CANVAS.items():
            if k in kw and rank[k] > rank.get(dep, len(layers)):
                del kw[k]                         # chosen for another canvas: derived instead
        if rank.get("block_length", len(layers)) > 0:     # not the request's own: fit it
            max_tokens = kw.get("max_tokens", knob_of(cls, "max_tokens").default)
            if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) \
                    and max_tokens >= 1:
                kw["block_length"] = fit_block_length(
                    max_tokens, kw.get("block_length", DEFAULT_BLOCK_LENGTH))
        return cls(**kw)

    def sources(self) -> dict[str, str]:
        """The source of every knob a layer sets (the highest layer that sets it)."""
        out: dict[str, str] = {}
        for source, values in self.layers:
            for k in values:
                out.setdefault(k, source)
        return out

    def effective(self, resolve=None) -> dict[str, Any]:
        """What a request that sends no knobs gets, knob by knob (``resolve(params)`` fills in
        what the model decides: the engine's ``resolve_params`` against its model, for the
        family's cache), with the source of each value that is not the recommended one."""
        p = self.params()
        if resolve is not None:
            p = resolve(p)
        src = self.sources()
        values = dataclasses.asdict(p)
        if "cache" not in src:
            src_cache = RECOMMENDED + " (the model family's fast cache)"
        else:
            src_cache = src["cache"]
        return {"values": values,
                "sources": {k: (src_cache if k == "cache" else src.get(k, RECOMMENDED))
                            for k in values}}
