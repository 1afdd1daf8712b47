"""What a model family declares: how to read its config.json, how its tensors are named, which
model class it builds, and how that model attends and what its MLP is.

A family is one module ``models/<family>.py`` exposing ``FAMILY`` and one line in
``models/registry.py`` (``registry.register`` for one defined elsewhere, e.g. a test)."""
from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from flash_dllm.layers.attention import BIDIRECTIONAL, AttentionPattern
from flash_dllm.models.config import MLP_KINDS, ModelConfig


@dataclass(frozen=True)
class Family:
    """One checkpoint family.

    ``parse_config`` turns a raw ``config.json`` into a ``ModelConfig`` (with ``arch`` = ``name``,
    and the attention pattern and MLP kind the family declares below); ``to_hf_config`` is its
    inverse (for writing checkpoints). ``model`` is the model class the family builds from a
    ``ModelConfig`` (``DiffusionTransformer`` for every family so far). What the rest of the
    package calls on it: ``cfg``, ``hidden`` / ``logits`` / ``greedy`` (the engine), ``forward``
    (the dense path; ``LLM.logits`` passes it a ``pattern``), ``fuse_projections``,
    ``init_weights``, and the module names that ``distributed/tp.py`` shards
    (``layers.{i}.attn.q_proj`` ...).

    ``attention``: how the family's models attend (the kind is fixed; a parser may read the block
    size from config.json). ``mlp``: the kind of its MLP layers ("dense" or "moe"; a
    mixture-of-experts family may keep some layers dense, ``ModelConfig.dense_layers``).
    ``default_cache``: the cache mode a request gets when it names none (``SamplingParams.cache``
    None): the family's fast cache, "dual" (approximate, Fast-dLLM's) for bidirectional
    families, "block" (exact) for block-causal ones. The engine checks that it runs on the
    family's models (``engine.core.resolve_params``).

    ``weight_map`` pairs checkpoint module paths with engine module paths, segment by segment;
    ``{i}`` stands for a layer index. A tensor name is its module path plus ``weight``/``bias``.
    Mapping is by whole dotted segments, so LLaDA's top-level ``ff_out`` (LM head) and a block's
    ``ff_out`` (down projection) can never be confused.

    ``split`` (optional) is for engine parameters a checkpoint stores differently: part of a fused
    tensor (LLaDA2's ``query_key_value`` holds q, k and v) or one of many (LLaDA2 stores each
    expert's projections apart, the engine packs them into ``w_gate_up`` / ``w_down``). Given an
    engine parameter's name, shape and the config, it returns the ``Piece`` s that fill it, or
    None for the one-to-one ``weight_map`` rule; the loader reads and the saver writes through
    it. ``check_tensors`` (optional) looks at every tensor name of a checkpoint before loading
    and returns a one-line error when they contradict the config in a way the family can name
    better than a list of missing tensors (a wrong ``num_experts``), else None.
    """

    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    parse_config: Callable[[dict], ModelConfig]
    to_hf_config: Callable[[ModelConfig], dict]
    weight_map: tuple[tuple[str, str], ...]
    model: Callable[[ModelConfig], nn.Module]
    attention: AttentionPattern = BIDIRECTIONAL
    mlp: str = "dense"
    default_cache: str = "dual"
    split: Callable[[str, tuple[int, ...], ModelConfig], tuple["Piece", ...] | None] | None = None
    check_tensors: Callable[[ModelConfig, list[str]], str | None] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.attention, AttentionPattern):
            raise ValueError(f"Family {self.name!r}: attention must be an AttentionPattern "
                             f"(layers.attention), got {self.attention!r}")
        if not isinstance(self.default_cache, str) or not self.default_cache:
            raise ValueError(f"Family {self.name!r}: default_cache must name a cache mode, "
                             f"got {self.default_cache!r}")
        if self.mlp not in MLP_KINDS:
            raise ValueError(f"Family {self.name!r}: mlp must be one of {MLP_KINDS}, "
                             f"got {self.mlp!r}")

    def check(self, cfg: ModelConfig) -> None:
        """Raise unless ``cfg`` is a config of this family, as it declares itself."""
        if cfg.arch != self.name:
            raise ValueError(f"a ModelConfig of arch {cfg.arch!r} is not a {self.name!r} config")
        if cfg.attention.kind != self.attention.kind:
            raise ValueError(f"the {self.name} family declares {self.attention.kind} attention, "
                             f"but its config says {cfg.attention}")
        if cfg.mlp_kind != self.mlp:
            raise ValueError(f"the {self.name} family declares {self.mlp!r} MLPs, but its "
                             f"config says mlp_kind={cfg.mlp_kind!r}")

    def build(self, cfg: ModelConfig, device: str | torch.device = "meta",
              dtype: torch.dtype = torch.float32) -> nn.Module:
        """The family's model of ``cfg``, parameters of ``dtype`` on ``device`` with uninitialised
        values (the loader fills them, ``init_weights`` draws them). On ``meta`` nothing is
        allocated: the loader builds there, shards for tensor parallelism, then allocates."""
        self.check(cfg)
        with default_dtype(dtype), torch.device("meta"):
            model = self.model(cfg)
        if torch.device(device).type == "meta":
            return model
        return model.to_empty(device=device)

    @staticmethod
    def _match(template: str, path: str) -> str | None:
        """The layer index bound by ``{i}`` ('' if none) when ``path`` fits ``template``, else None."""
        pat = "^" + re.escape(template).replace(r"\{i\}", r"(\d+)") + "$"
        m = re.match(pat, path)
        if m is None:
            return None
        return m.group(1) if m.groups() else ""

    def to_engine_name(self, ckpt_name: str) -> str | None:
        """Checkpoint tensor name -> engine parameter name, or None if no rule covers it."""
        path, _, leaf = ckpt_name.rpartition(".")
        for ckpt, ours in self.weight_map:
            i = self._match(ckpt, path)
            if i is not None:
                return ours.replace("{i}", i) + "." + leaf
        return None

    def pieces(self, engine_name: str, shape: tuple[int, ...],
               cfg: ModelConfig) -> tuple["Piece", ...]:
        """The checkpoint tensors (or slices of them) that make up the engine parameter
        ``engine_name`` of full shape ``shape``."""
        if self.split is not None:
            out = self.split(engine_name, tuple(shape), cfg)
            if out is not None:
                return out
        return (Piece(self.to_ckpt_name(engine_name), tuple(shape)),)

    def to_ckpt_name(self, engine_name: str) -> str:
        """Engine parameter name -> checkpoint tensor name (for writing checkpoints)."""
        path, _, leaf = engine_name.rpartition(".")
        for ckpt, ours in self.weight_map:
            i = self._match(ours, path)
            if i is not None:
                return ckpt.replace("{i}", i) + "." + leaf
        raise KeyError(f"no checkpoint name for engine parameter {engine_name!r}")


@dataclass(frozen=True)
class Piece:
    """One checkpoint tensor's share of an engine parameter: loading does
    ``param[dest] = tensor[src]``, saving ``tensor[src] = param[dest]`` (``()``: all of it)."""

    ckpt: str                      # the checkpoint tensor's name
    shape: tuple[int, ...]         # the whole checkpoint tensor's shape
    dest: tuple = ()               # index into the engine parameter
    src: tuple = ()                # index into the checkpoint tensor

    @property
    def whole(self) -> bool:
        """The parameter is exactly this checkpoint tensor."""
        return self.dest == () and self.src == ()


_PACKED = re.compile(r"layers\.(\d+)\.mlp\.(w_gate_up|w_down)")


def expert_pieces(name: str, shape: tuple[int, ...]) -> tuple[Piece, ...] | None:
    """The packed experts of a MoE layer (``w_gate_up`` [E, 2I, d]: each expert's gate rows, then
    its up rows; ``w_down`` [E, d, I]) from one checkpoint tensor per expert and projection,
    ``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``: the names LLaDA2,
    LLaDA-MoE and SDAR-MoE (Qwen-MoE style) all use. None for any other parameter."""
    m = _PACKED.fullmatch(name)
    if m is None:
        return None
    i, packed = m.groups()
    prefix = f"model.layers.{i}.mlp.experts"
    if packed == "w_gate_up":
        E, two_i, d = shape
        inter = two_i // 2
        return tuple(Piece(f"{prefix}.{e}.{proj}.weight", (inter, d),
                           dest=(e, slice(start, start + inter)))
                     for e in range(E) for proj, start in (("gate_proj", 0), ("up_proj", inter)))
    E, d, inter = shape
    return tuple(Piece(f"{prefix}.{e}.down_proj.weight", (d, inter), dest=(e,))
                 for e in range(E))


_EXPERT_NAME = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")


def check_expert_count(cfg: ModelConfig, names: list[str]) -> str | None:
    """A MoE layer holding another number of experts than config.json's ``num_experts`` (in
    ``expert_pieces``' names), as a one-line error; else None."""
    top: dict[int, int] = {}
    for name in names:
        m = _EXPERT_NAME.match(name)
        if m is not None:
            layer, e = int(m.group(1)), int(m.group(2))
            top[layer] = max(top.get(layer, -1), e)
    for layer in sorted(top):
        n = top[layer] + 1
        if layer < cfg.num_layers and cfg.layer_mlp_kind(layer) == "moe" \
                and n != cfg.moe.num_experts:
            return (f"config.json sets num_experts={cfg.moe.num_experts}, but layer {layer} of "
                    f"the checkpoint holds experts 0..{n - 1} "
                    f"(model.layers.{layer}.mlp.experts.{n - 1}.*)")
    return None


def refuse_unsupported(raw: dict, supported: dict, family: str) -> None:
    """Raise naming the key when ``raw`` sets a switch of ``supported`` (key -> the values the
    family implements) to another value; absent or null passes."""
    for key, ok in supported.items():
        value = raw.get(key)
        if value is not None and value not in ok:
            raise ValueError(f"{family} config.json sets {key}={value!r}, which flash-dllm does "
                             f"not support (supported: {' or '.join(map(repr, ok))})")


def require(raw: dict, key: str, family: str):
    if key not in raw or raw[key] is None:
        raise ValueError(f"{family} config.json is missing required key {key!r}")
    return raw[key]


def as_id_tuple(*values) -> tuple[int, ...]:
    """Flatten ints / lists of ints / None into a de-duplicated tuple, order kept."""
    out: list[int] = []
    for v in values:
        for x in (v if isinstance(v, (list, tuple)) else [v]):
            if x is not None and int(x) not in out:
                out.append(int(x))
    return tuple(out)


@contextmanager
def default_dtype(dtype: torch.dtype):
    """``torch.set_default_dtype(dtype)`` for the block (floating parameters are made in it)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)
