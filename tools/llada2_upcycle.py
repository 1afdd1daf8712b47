"""Sparse upcycling: a trained dense LLaDA-format proxy -> the first weights of a LLaDA2-format
(block-causal MoE) proxy, as close to the dense model's function as the new layout allows.

What maps how (``upcycle``):

- embeddings, LM head, final norm, every layer's two norms, the output projection: copied.
- **rotary** (the trap): LLaDA rotates all ``D`` values of a head, pairs ``(i, i + D/2)`` at
  ``theta^(-2i/D)``; LLaDA2 rotates the first ``R = D * partial_rotary_factor`` values, pairs
  ``(j, j + R/2)`` at ``theta2^(-2j/R)``. With ``theta2 = theta^(R/D)`` the new pair j turns at
  exactly the dense pair j's rate, so the head dims of q and k are permuted (``rotary_perm``)
  to put the dense model's R/2 fastest pairs in the rotated slots; its slowest pairs (at
  theta 1e4, D 64: <= 0.01 rad per position) land in the pass-through half and stop turning.
- **GQA**: each KV head is the mean of its group's K (permuted) / V heads (the GQA paper's
  conversion).
- **q/k norm** (the dense model has none): weights filled with the mean per-head RMS of the
  dense q / k on calibration tokens, so a typical head keeps its scale.
- **MLP**: layers below ``first_k_dense_replace`` keep the dense SwiGLU; every other layer's
  neurons are ranked by importance (mean |silu(gate) * up| times the norm of their down column),
  the ``(E + 1) * I`` best kept: the ``I`` best form the shared expert, the rest are clustered
  by co-activation into ``E`` experts of ``I`` (balanced k-means), MoEfication-style. The
  router is a least-squares fit of each expert's (standardised) output norm, times
  ``router_scale``; ``expert_bias`` centres each expert's mean score. With
  ``routed_scaling_factor = top_k`` and equal scores each chosen expert weighs 1, so the MoE is
  the dense MLP's sum over the kept neurons of the shared and chosen experts (all experts
  chosen and nothing pruned: the dense MLP itself, ``test_train_llada2_proxy``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from flash_dllm.layers.attention import DenseContext


def rotary_perm(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """new head dim k holds dense head dim ``perm[k]`` (see the module note)."""
    D, R = head_dim, rotary_dim
    h, r = D // 2, R // 2
    return torch.cat([torch.arange(0, r), torch.arange(h, h + r),          # rotated pairs
                      torch.arange(r, h), torch.arange(h + r, D)])         # pass-through


def upcycled_theta(dense_theta: float, head_dim: int, rotary_dim: int) -> float:
    return dense_theta ** (rotary_dim / head_dim)


@torch.no_grad()
def _calibration(dense, ids: torch.Tensor, key_mask: torch.Tensor, max_rows: int):
    """Per layer: the dense model's attention inputs and MLP inputs at real tokens, [N, d]."""
    attn_in, mlp_in, hooks = {}, {}, []
    keep = key_mask.reshape(-1)
    for i, layer in enumerate(dense.layers):
        hooks.append(layer.attn.register_forward_hook(
            lambda m, a, o, i=i: attn_in.__setitem__(i, a[0].reshape(-1, a[0].shape[-1])[keep])))
        hooks.append(layer.mlp.register_forward_hook(
            lambda m, a, o, i=i: mlp_in.__setitem__(i, a[0].reshape(-1, a[0].shape[-1])[keep])))
    try:
        positions = torch.arange(ids.shape[1], device=ids.device)
        dense.hidden(ids, positions, DenseContext(key_mask))
    finally:
        for h in hooks:
            h.remove()
    g = torch.Generator(device="cpu").manual_seed(0)
    n = int(keep.sum())
    rows = torch.randperm(n, generator=g)[:max_rows].to(ids.device)
    return ({i: a[rows].float() for i, a in attn_in.items()},
            {i: m[rows].float() for i, m in mlp_in.items()})


def _balanced_assign(aff: torch.Tensor, cap: int) -> torch.Tensor:
    """Greedy assignment of rows (neurons) to columns (experts), ``cap`` rows per column, best
    affinity first -> column per row."""
    n, E = aff.shape
    order = torch.argsort(aff.flatten(), descending=True, stable=True).tolist()
    col = [-1] * n
    load = [0] * E
    left = n
    for flat in order:
        r, c = divmod(flat, E)
        if col[r] < 0 and load[c] < cap:
            col[r], load[c] = c, load[c] + 1
            left -= 1
            if not left:
                break
    return torch.tensor(col)


def cluster_neurons(act: torch.Tensor, n_experts: int, iters: int = 10,
                    seed: int = 0) -> list[torch.Tensor]:
    """Balanced k-means of neurons by co-activation: act [tokens, neurons] -> ``n_experts``
    index tensors of ``neurons / n_experts`` neurons each."""
    feat = F.normalize(act.abs().t().float(), dim=1).cpu()                # [n, tokens]
    n = feat.shape[0]
    cap = n // n_experts
    g = torch.Generator().manual_seed(seed)
    cent = feat[torch.randperm(n, generator=g)[:n_experts]]               # [E, tokens]
    col = None
    for _ in range(iters):
        col = _balanced_assign(feat @ cent.t(), cap)
        cent = F.normalize(torch.stack([feat[col == e].mean(0) for e in range(n_experts)]),
                           dim=1)
    return [torch.nonzero(col == e).flatten() for e in range(n_experts)]


@torch.no_grad()
def _upcycle_mlp(dense_mlp, moe, x: torch.Tensor, router_scale: float, seed: int) -> dict:
    cfg = moe.cfg
    E, I, k = cfg.num_experts, cfg.intermediate_size, cfg.top_k
    wg, wu, wd = (dense_mlp.gate_proj.weight.float(), dense_mlp.up_proj.weight.float(),
                  dense_mlp.down_proj.weight.float())                    # [F, d] x2, [d, F]
    width = wg.shape[0]
    if (E + 1) * I > width or cfg.num_shared_experts != 1:
        raise ValueError(f"upcycling needs one shared expert and (E + 1) * I = {(E + 1) * I} "
                         f"<= the dense width {width}")
    h = F.silu(x @ wg.t()) * (x @ wu.t())                                # [N, F]
    col_norm = wd.norm(dim=0)                                            # [F]
    contrib = h * col_norm
    importance = contrib.abs().mean(0)
    ranked = torch.argsort(importance, descending=True, stable=True)
    shared, rest = ranked[:I], ranked[I:(E + 1) * I]
    groups = [rest[g.to(rest.device)] for g in cluster_neurons(contrib[:, rest], E, seed=seed)]
    moe.shared.gate_proj.weight.copy_(wg[shared])
    moe.shared.up_proj.weight.copy_(wu[shared])
    moe.shared.down_proj.weight.copy_(wd[:, shared])
    for e, idx in enumerate(groups):
        moe.w_gate_up[e].copy_(torch.cat([wg[idx], wu[idx]]))
        moe.w_down[e].copy_(wd[:, idx])
    # router: least squares from the input to each expert's standardised output norm
    y = torch.stack([(h[:, idx] @ wd[:, idx].t()).norm(dim=1) for idx in groups], 1)  # [N, E]
    z = (y - y.mean(0)) / (y.std(0) + 1e-6)
    xa = torch.cat([x, torch.ones_like(x[:, :1])], 1)
    sol = torch.linalg.lstsq(xa.cpu().double(), z.cpu().double()).solution.float()   # [d+1, E]
    moe.gate.weight.copy_(router_scale * sol[:-1].t())
    s = torch.sigmoid(x @ moe.gate.weight.float().t())                  # [N, E]
    moe.gate.expert_bias.copy_(0.5 - s.mean(0))
    kept = h[:, ranked[:(E + 1) * I]] @ wd[:, ranked[:(E + 1) * I]].t()
    full = h @ wd.t()
    return {"kept_rel_err": float((kept - full).norm() / full.norm()),
            # share of the standardised target the router's fit explains
            "router_r2": float(1 - ((xa.cpu() @ sol - z.cpu()) ** 2).mean()),
            "top_k": k}


@torch.no_grad()
def upcycle(dense, model, ids: torch.Tensor, key_mask: torch.Tensor,
            router_scale: float = 0.5, max_rows: int = 8192, seed: int = 0) -> dict:
    """Fill ``model`` (LLaDA2 ``DiffusionTransformer``) from ``dense`` (LLaDA one) in place;
    ``ids`` / ``key_mask`` [B, L]: calibration canvases. Returns per-layer diagnostics."""
    dc, nc = dense.cfg, model.cfg
    D, R = nc.head_dim, nc.rotary_dim or nc.head_dim
    same = ("hidden_size", "num_layers", "num_heads", "head_dim", "vocab_size")
    bad = [k for k in same if getattr(dc, k) != getattr(nc, k)]
    if bad or dc.num_kv_heads != dc.num_heads or dc.rotary_dim is not None:
        raise ValueError(f"upcycling needs equal {bad or same} and a full-rotary MHA dense model")
    want = upcycled_theta(dc.rope_theta, D, R)
    if abs(nc.rope_theta - want) > 1e-6 * want:
        raise ValueError(f"the LLaDA2 config's rope_theta must be {want} (dense theta "
                         f"{dc.rope_theta} ** {R}/{D}) for the rotary to carry over, got "
                         f"{nc.rope_theta}")
    attn_in, mlp_in = _calibration(dense, ids, key_mask, max_rows)
    model.embed.weight.copy_(dense.embed.weight)
    model.lm_head.weight.copy_(dense.lm_head.weight)
    model.norm.weight.copy_(dense.norm.weight)
    H, Hkv = nc.num_heads, nc.num_kv_heads
    perm = rotary_perm(D, R).to(ids.device)
    report = []
    for i, (src, dst) in enumerate(zip(dense.layers, model.layers)):
        dst.attn_norm.weight.copy_(src.attn_norm.weight)
        dst.mlp_norm.weight.copy_(src.mlp_norm.weight)
        d = nc.hidden_size
        wq = src.attn.q_proj.weight.view(H, D, d)[:, perm]                 # [H, D, d]
        wk = src.attn.k_proj.weight.view(H, D, d)[:, perm]
        wv = src.attn.v_proj.weight.view(H, D, d)
        dst.attn.q_proj.weight.copy_(wq.reshape(H * D, d))
        dst.attn.k_proj.weight.copy_(wk.view(Hkv, H // Hkv, D, d).mean(1).reshape(Hkv * D, d))
        dst.attn.v_proj.weight.copy_(wv.view(Hkv, H // Hkv, D, d).mean(1).reshape(Hkv * D, d))
        dst.attn.o_proj.weight.copy_(src.attn.o_proj.weight)
        x = attn_in[i]
        q_rms = (x @ wq.reshape(H * D, d).t().float()).view(-1, H, D).pow(2).mean(-1).sqrt()
        k_rms = (x @ wk.reshape(H * D, d).t().float()).view(-1, H, D).pow(2).mean(-1).sqrt()
        if dst.attn.q_norm is not None:
            dst.attn.q_norm.weight.fill_(float(q_rms.mean()))
            dst.attn.k_norm.weight.fill_(float(k_rms.mean()))
        if nc.layer_mlp_kind(i) == "dense":
            if dst.mlp.gate_proj.weight.shape != src.mlp.gate_proj.weight.shape:
                raise ValueError(f"layer {i}: the dense MLP's width must stay "
                                 f"{src.mlp.gate_proj.weight.shape[0]}")
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(dst.mlp, name).weight.copy_(getattr(src.mlp, name).weight)
            report.append({"layer": i, "mlp": "dense"})
        else:
            report.append({"layer": i, "mlp": "moe",
                           **_upcycle_mlp(src.mlp, dst.mlp, mlp_in[i], router_scale, seed + i)})
    return {"layers": report}
