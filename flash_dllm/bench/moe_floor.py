"""``bench step`` on mixture-of-experts shapes: which routed experts a step reads, its weight-read
floor from them, and ``--routing uniform`` (a balanced router's choices on random weights)."""
from __future__ import annotations

import torch

from flash_dllm.cache.modes import CACHE_MODES
from flash_dllm.layers.moe import MoE
from flash_dllm.models.config import ModelConfig


def weight_read_bytes(model, cfg: ModelConfig, tokens: int,
                      touched: list[int] | None = None) -> float:
    """Weight bytes a step of ``tokens`` routed rows reads: every weight, but of a MoE layer's
    routed experts only those its tokens reach: ``touched`` (measured, one count per MoE
    layer), or at uniform routing (E (1 - (1 - k/E)^tokens) distinct experts per layer). The
    embedding counts whole, as in the dense shapes' floors."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if cfg.mlp_kind != "moe":
        return total
    m = cfg.moe
    per_expert = expert_bytes(model) / m.num_experts
    if touched is not None:
        return total - sum(m.num_experts - t for t in touched) * per_expert
    untouched = m.num_experts * (1 - m.top_k / m.num_experts) ** tokens
    layers = sum(cfg.layer_mlp_kind(i) == "moe" for i in range(cfg.num_layers))
    return total - layers * untouched * per_expert


def expert_bytes(model) -> int:
    """Bytes of one MoE layer's routed experts as stored (quantized ones included)."""
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    parts = (list(moe.quant_experts.parameters()) if moe.quant_experts is not None
             else [moe.w_gate_up, moe.w_down])
    return sum(p.numel() * p.element_size() for p in parts)


ROUTINGS = ("model", "uniform")
UNIFORM_TABLE_ROWS = 4096     # distinct choices per row; row r uses entry r mod this


def install_uniform_routing(model, seed: int = 0) -> int:
    """``--routing uniform``: every MoE layer's router is replaced by a fixed table of choices,
    each row's ``top_k`` experts drawn uniformly without replacement (row ``r`` of a step takes
    entry ``r mod UNIFORM_TABLE_ROWS``), mixing weights equal. What a balanced router reads,
    which random router weights do not: their rows, all alike, crowd onto a few experts, so a
    step reads fewer experts than a trained model's would. Static tensors indexed by the step's
    row count: capturable in a CUDA graph. Returns the number of layers changed."""
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    g = torch.Generator().manual_seed(seed)
    for m in moes:
        E, k = m.cfg.num_experts, m.cfg.top_k
        dev = m.gate.weight.device
        table = torch.rand(UNIFORM_TABLE_ROWS, E, generator=g).argsort(dim=1)[:, :k].to(dev)
        weight = torch.full((1, k), m.cfg.routed_scaling_factor / k, device=dev)

        def route(x, table=table, weight=weight):
            rows = torch.arange(x.shape[0], device=x.device) % UNIFORM_TABLE_ROWS
            ids = table[rows]
            return ids, weight.expand(ids.shape[0], -1)
        route.table = table
        m.route = route                      # an instance attribute over the method
    return len(moes)


def uniform_touched(model, rows: int) -> list[int]:
    """Distinct experts each MoE layer's installed uniform table gives a step of ``rows`` rows
    (the step's rows take table entries 0..rows-1, whatever request they belong to)."""
    return [int(m.route.table[torch.arange(rows) % UNIFORM_TABLE_ROWS].unique().numel())
            for m in model.modules() if isinstance(m, MoE)]


@torch.no_grad()
def touched_experts(model, reqs, cache: str) -> list[int]:
    """Distinct routed experts each MoE layer reads in one step of ``reqs`` as they stand,
    measured: each request's canvas through the model's dense forward (its own attention
    pattern, so a block-causal row sees what the step's row sees), the router's choices kept
    for the rows the step computes (the active block; every row with ``cache="none"``)."""
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    hit = [torch.zeros(m.cfg.num_experts, dtype=torch.bool) for m in moes]
    rows = [slice(0, 0)]

    def recorder(i, route):
        def record(x):
            ids, w = route(x)
            hit[i][ids[rows[0]].reshape(-1).cpu()] = True
            return ids, w
        return record

    before = [m.__dict__.get("route") for m in moes]     # an installed routing, if any
    for i, m in enumerate(moes):
        m.route = recorder(i, m.route)           # an instance attribute over the method
    try:
        dev = next(model.parameters()).device
        for r in reqs:
            rows[0] = (slice(r.block_start, r.block_end) if CACHE_MODES[cache].keeps_kv
                       else slice(0, None))
            model(r.canvas[None].to(dev))
    finally:
        for m, b in zip(moes, before):
            if b is None:
                del m.route
            else:
                m.route = b
    return [int(h.sum()) for h in hit]


def set_routing(model, cfg: ModelConfig, routing: str, shape: str) -> None:
    """``--routing``: "model" (the random router's own choices) or "uniform" (checked here)."""
    if routing not in ROUTINGS:
        raise ValueError(f"--routing must be one of {ROUTINGS}, got {routing!r}")
    if routing == "uniform":
        if cfg.mlp_kind != "moe":
            raise ValueError(f"--routing uniform needs a mixture-of-experts shape, "
                             f"got {shape!r}")
        install_uniform_routing(model)


def moe_floor(model, cfg: ModelConfig, r: dict, rows_routed: int, bw: float,
              routing: str) -> dict:
    """The floor fields of one case's row ``r`` (``bench_case``'s report) on a MoE model whose
    step routes ``rows_routed`` rows, at ``bw`` bytes/s of copy bandwidth."""
    uniform = weight_read_bytes(model, cfg, rows_routed)
    out = {"floor_ms_uniform_routing": 1e3 * uniform / bw}
    touched = r["experts_touched"]
    if routing == "uniform" and touched is not None:
        # the table, not each request's dense forward alone: in the step, request j's rows
        # take other table entries than request 0's
        touched = out["experts_touched"] = uniform_touched(model, rows_routed)
    out["weight_read_bytes"] = (weight_read_bytes(model, cfg, rows_routed, touched)
                                if touched is not None else uniform)
    out["floor_ms"] = 1e3 * out["weight_read_bytes"] / bw
    out["active_params"] = cfg.active_params()
    return out
