"""The masked-confidence study kernel (LM head + argmax, max-prob, entropy) against its reference,
under the interpreter (``TRITON_INTERPRET=1``, set by this folder's conftest on a machine with no
GPU), and the reference against dense PyTorch. Moved from ``tests/test_kernels.py``.
"""
from __future__ import annotations

import pytest
import torch

import confidence
from flash_dllm.kernels._triton import HAS_TRITON

INTERPRETED = HAS_TRITON and confidence.INTERPRET
needs_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="triton is not installed" if not HAS_TRITON else
    "triton runs compiled here (a GPU machine): see test_studies_gpu.py")


def _interpreter_loops_to_loaded_bounds() -> bool:
    """Older interpreters (seen: Triton 3.6) call ``int()`` on the 1-element array of a loaded
    scalar, which numpy >= 2.4 refuses; the compiled GPU path is unaffected."""
    if not INTERPRETED:
        return False
    import triton
    import triton.language as tl

    @triton.jit
    def _probe(n_ptr, out_ptr):
        n = tl.load(n_ptr)
        for i in range(0, n, 1):
            tl.store(out_ptr, i)

    out = torch.zeros(1, dtype=torch.int32)
    try:
        _probe[(1,)](torch.tensor([3], dtype=torch.int32), out)
    except Exception:  # noqa: BLE001 - any failure means "cannot", reported as the skip reason
        return False
    return out.item() == 2


LOADED_BOUNDS = _interpreter_loops_to_loaded_bounds()
needs_loaded_bounds = pytest.mark.skipif(
    INTERPRETED and not LOADED_BOUNDS,
    reason="this triton's interpreter cannot loop to a loaded bound under numpy >= 2.4 "
           "(newer triton can; CI installs the latest)")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rand(*shape, dtype=torch.float32, seed=0, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=_gen(seed)) * scale).to(dtype)


def _confidence_inputs(N, d, V, dtype, seed, planted):
    h = _rand(N, d, seed=seed)
    w = _rand(V, d, seed=seed + 1, scale=0.5)
    # plant a column that wins most rows, so excluding it changes the argmax
    w[planted] = h.mean(0) * 3.0 / h.mean(0).norm()
    return h.to(dtype), w.to(dtype)


def _check_confidence(got, h, w, exclude, dtype):
    tok, conf, ent = got
    ref_tok, ref_conf, ref_ent = confidence.confidence_reference(h, w, exclude)
    logits = h.float() @ w.float().t()
    if exclude is not None:
        assert not (tok == exclude).any()
        logits[:, exclude] = float("-inf")
    best = logits.max(-1).values
    # the chosen token's logit is the max (exact ties may pick either on another summation order)
    torch.testing.assert_close(logits.gather(1, tok[:, None])[:, 0], best, rtol=0, atol=1e-4)
    assert (tok == ref_tok).float().mean() >= 0.9
    assert tok.dtype == torch.int64 and conf.dtype == torch.float32 and ent.dtype == torch.float32
    torch.testing.assert_close(conf, ref_conf, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-4, atol=1e-4)


@needs_interpreter
@needs_loaded_bounds
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("exclude", [None, 5])
def test_confidence_triton_matches_reference(dtype, exclude):
    N, d, V = 19, 40, 300                                # V not a multiple of block_v=32
    h, w = _confidence_inputs(N, d, V, dtype, seed=10, planted=5)
    if exclude is not None:
        assert (confidence.confidence_reference(h, w)[0] == exclude).any()   # exclusion matters
    got = confidence.confidence_triton(h, w, exclude, block_m=16, block_v=32, block_k=16)
    _check_confidence(got, h, w, exclude, dtype)


@needs_interpreter
@needs_loaded_bounds
@pytest.mark.parametrize("num_splits", [1, 4])
def test_confidence_triton_splits(num_splits):
    h, w = _confidence_inputs(5, 24, 100, torch.float32, seed=11, planted=99)  # last column
    got = confidence.confidence_triton(h, w, 99, block_m=16, block_v=16, block_k=16,
                                       num_splits=num_splits)
    _check_confidence(got, h, w, 99, torch.float32)


def test_confidence_reference_matches_softmax():
    h, w = _confidence_inputs(6, 16, 50, torch.float32, seed=12, planted=3)
    probs = torch.softmax(h.double() @ w.double().t(), dim=-1)              # [N, V]
    tok, conf, ent = confidence.confidence_reference(h, w, exclude=3)
    masked = probs.clone()
    masked[:, 3] = -1.0
    assert torch.equal(tok, masked.argmax(-1))
    torch.testing.assert_close(conf.double(), probs.gather(1, tok[:, None])[:, 0], rtol=1e-5,
                               atol=1e-6)
    torch.testing.assert_close(ent.double(), -(probs * probs.log()).sum(-1), rtol=1e-5, atol=1e-5)
    # and the engine's own proposer agrees on token and confidence
    from flash_dllm.decoding.sampling import propose
    p_tok, p_conf = propose(h @ w.t(), [], forbid=3)
    assert torch.equal(p_tok, tok)
    torch.testing.assert_close(p_conf, conf)


def test_op_dispatches_to_reference_on_cpu():
    h, wt = _confidence_inputs(4, 8, 30, torch.float32, seed=63, planted=1)
    for a, b in zip(confidence.op(h, wt, 1), confidence.confidence_reference(h, wt, 1)):
        assert torch.equal(a, b)


@needs_interpreter
@needs_loaded_bounds
def test_op_routes_to_triton_when_allowed(monkeypatch):
    """The op() glue on the Triton branch, forced on CPU tensors."""
    monkeypatch.setattr(confidence, "use_triton", lambda *t: True)
    h, wt = _confidence_inputs(3, 16, 40, torch.float32, seed=83, planted=2)
    _check_confidence(confidence.op(h, wt, 2), h, wt, 2, torch.float32)


@needs_interpreter
def test_launcher_rejects_bad_layouts():
    with pytest.raises(ValueError, match="weight dtype"):
        confidence.confidence_triton(_rand(2, 8), _rand(9, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="exclude"):
        confidence.confidence_triton(_rand(2, 8), _rand(9, 8), exclude=9)
