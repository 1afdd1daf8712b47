"""Knobs (issue 38): a ``SamplingParams`` / ``EngineConfig`` field is declared once with its help,
range and flag; the checks, the CLI flags and the HTTP body fields are generated from it. Adding a
knob is one field: the variants below add one in the test and reach the parser and the body
model without touching ``entrypoints/args.py`` or ``server/protocol.py``."""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

import pytest
from pydantic import ValidationError

from flash_dllm.config import EngineConfig, SamplingParams
from flash_dllm.entrypoints.args import (EngineArgs, add_knob_flags, add_sampling_flags,
                                         knob_values, sampling_from_args)
from flash_dllm.entrypoints.cli import build_parser
from flash_dllm.knobs import knob, knobs
from flash_dllm.server.protocol import DLLMKnobs, knob_model


@dataclass(frozen=True)
class WithFoo(SamplingParams):
    foo_scale: float | None = knob(None, "a new per-request knob (default: off)", gt=0, le=1)


@dataclass(frozen=True)
class WithBar(EngineConfig):
    bar_pages: int = knob(4, "a new engine knob (default: %(default)s)", ge=1)


def _parser(add) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="t", exit_on_error=False)
    add(p)
    return p


def test_a_new_sampling_knob_is_one_field():
    assert WithFoo(max_tokens=8, foo_scale=0.5).foo_scale == 0.5
    with pytest.raises(ValueError, match=r"foo_scale must be in \(0, 1\] or None, got 1.5"):
        WithFoo(foo_scale=1.5)

    # the CLI: a flag with its help and default; the value is checked where the params are built
    p = _parser(lambda p: add_sampling_flags(p, cls=WithFoo))
    assert "--foo-scale FOO_SCALE" in p.format_help()
    assert "a new per-request knob (default: off)" in p.format_help()
    assert sampling_from_args(p.parse_args([]), cls=WithFoo).foo_scale is None
    got = sampling_from_args(p.parse_args(["--foo-scale", "0.25", "--max-tokens", "8"]),
                             cls=WithFoo)
    assert (type(got), got.foo_scale, got.max_tokens) == (WithFoo, 0.25, 8)
    with pytest.raises(argparse.ArgumentError, match="invalid float value"):
        p.parse_args(["--foo-scale", "lots"])
    with pytest.raises(ValueError, match="foo_scale must be in"):
        sampling_from_args(p.parse_args(["--foo-scale", "2"]), cls=WithFoo)

    # the HTTP body: a strict field of the knob's type, its range checked as the dataclass does
    Body = knob_model(WithFoo, "FooKnobs")
    assert set(Body.model_fields) == set(DLLMKnobs.model_fields) | {"foo_scale"}
    assert Body.model_fields["foo_scale"].description == "a new per-request knob (default: off)"
    params = Body.model_validate({"foo_scale": 0.75, "decode": "threshold"}).sampling_params(16)
    assert (type(params), params.foo_scale, params.decode) == (WithFoo, 0.75, "threshold")
    assert Body.model_validate({}).sampling_params(None).foo_scale is None
    with pytest.raises(ValidationError, match="foo_scale"):
        Body.model_validate({"foo_scale": "0.5"})                    # strict: no coercion
    with pytest.raises(ValueError, match=r"foo_scale must be in \(0, 1\] or None, got 2.0"):
        Body.model_validate({"foo_scale": 2.0}).sampling_params(16)
    with pytest.raises(ValidationError, match="foo_scale"):
        DLLMKnobs.model_validate({"foo_scale": 0.5})                 # not a knob of the real one


def test_a_new_engine_knob_is_one_field():
    p = _parser(lambda p: add_knob_flags(p, WithBar))
    assert "a new engine knob (default: 4)" in p.format_help()
    assert WithBar(**knob_values(p.parse_args(["--bar-pages", "3"]), WithBar)).bar_pages == 3
    with pytest.raises(ValueError, match="bar_pages must be an integer >= 1, got 0"):
        WithBar(**knob_values(p.parse_args(["--bar-pages", "0"]), WithBar))
    # knobs without a flag stay without one (as before: tests and benchmarks set them)
    assert "--kv-tier-stress" not in p.format_help()


def test_every_field_is_a_knob_and_every_flagged_knob_has_its_flag():
    with pytest.raises(TypeError, match="Plain.x is not declared with knob"):
        knobs(dataclass(frozen=True)(type("Plain", (), {"__annotations__": {"x": "int"},
                                                         "x": 1})))
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for command, classes in (("generate", (SamplingParams, EngineConfig)),
                             ("eval", (SamplingParams, EngineConfig)),
                             ("serve", (EngineConfig,))):
        flags = {s for a in sub.choices[command]._actions for s in a.option_strings}
        for cls in classes:
            for k in knobs(cls):
                assert (k.flag_name in flags) == k.cli, (command, k.name)
    # EngineArgs holds a field per flagged EngineConfig knob, with its default
    args = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    assert all(args[k.name] == k.default for k in knobs(EngineConfig) if k.cli)
    assert not {k.name for k in knobs(EngineConfig) if not k.cli} & set(args)


def test_cli_values_reach_the_dataclasses():
    a = build_parser().parse_args(
        ["generate", "hi", "--no-early-stop", "--no-drift-defer", "--cache", "dual",
         "--drift-min", "0.5", "--seed", "3", "--max-tokens", "16", "--kv-top-k", "2",
         "--no-cuda-graphs", "--kv-placement", "ema", "--max-num-seqs", "5"])
    p = sampling_from_args(a)
    assert (p.early_stop, p.drift_defer, p.cache, p.drift_min, p.seed, p.max_tokens,
            p.kv_top_k) == (False, False, "dual", 0.5, 3, 16, 2)
    c = EngineArgs.from_cli_args(a).engine_config()
    assert (c.cuda_graphs, c.kv_placement, c.max_num_seqs) == (False, "ema", 5)
    d = build_parser().parse_args(["generate", "hi"])
    assert sampling_from_args(d) == SamplingParams()
    assert EngineArgs.from_cli_args(d).engine_config() == EngineConfig()


def test_choices_are_read_when_used():
    """A choice list that grows after import (a registry's live view: a decode policy or cache
    mode registered at run time) is accepted by the check, by a parser built after it and by a
    body model built before it."""
    names = ["one"]

    @dataclass(frozen=True)
    class WithMode(SamplingParams):
        mode: str = knob("one", "a registry-backed choice", choices=names)

    Body = knob_model(WithMode, "ModeKnobs")
    with pytest.raises(ValueError, match=r"mode must be one of \['one'\], got 'two'"):
        WithMode(mode="two")
    names.append("two")
    assert WithMode(mode="two").mode == "two"
    p = _parser(lambda p: add_sampling_flags(p, cls=WithMode))
    assert sampling_from_args(p.parse_args(["--mode", "two"]), cls=WithMode).mode == "two"
    assert Body.model_validate({"mode": "two"}).sampling_params(8).mode == "two"
    with pytest.raises(ValueError, match=r"mode must be one of \['one', 'two'\], got 'six'"):
        Body.model_validate({"mode": "six"}).sampling_params(8)


@pytest.mark.parametrize("cls,kw,message", [
    (SamplingParams, dict(max_tokens=0), "max_tokens must be an integer >= 1, got 0"),
    (SamplingParams, dict(max_tokens=8.0), "max_tokens must be an integer >= 1, got 8.0"),
    (SamplingParams, dict(top_k=True), "top_k must be an integer >= 0, got True"),
    (SamplingParams, dict(temperature=float("nan")), r"temperature must be a finite number in \[0, 100\], got nan"),
    (SamplingParams, dict(seed=2**64), r"seed must be an integer in \[0, 18446744073709551615\] "
                                       r"or None, got 18446744073709551616"),
    (SamplingParams, dict(gamma=float("inf")), "gamma must be a finite number > 0, got inf"),
    (SamplingParams, dict(early_stop=0), "early_stop must be a bool, got 0"),
    (SamplingParams, dict(decode="greedy"), r"decode must be one of \['vanilla', 'threshold', "
                                            r"'verify', 'llada2', 'edit'\], got 'greedy'"),
    (EngineConfig, dict(kv_cache_gb=0), "kv_cache_gb must be a finite number > 0, got 0"),
    (EngineConfig, dict(kv_cpu_gb=-1.0), r"kv_cpu_gb must be in \[0, 1048576\), got -1.0"),
    (EngineConfig, dict(gpu_memory_utilization=1.0),
     r"gpu_memory_utilization must be in \(0, 1\) or None, got 1.0"),
    (EngineConfig, dict(kv_placement="fifo"),
     r"kv_placement must be one of \['lru', 'ema', 'kag'\] or None, got 'fifo'"),
    (EngineConfig, dict(kag_update=4), "kag_update must be a string, got 4"),
    (EngineConfig, dict(kv_disk_path=3, kv_disk_gb=1.0), "kv_disk_path must be a string or None"),
])
def test_messages_name_the_field_and_what_it_accepts(cls, kw, message):
    with pytest.raises(ValueError, match=message):
        cls(**kw)
