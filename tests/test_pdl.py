"""Programmatic dependent launch's host side (``kernels/_triton``): opt-in, and off on the CPU
and under the interpreter; the weight prefetch's budget. The kernels' PDL path itself runs
on a GPU (``tests/gpu/test_pdl_gpu.py``)."""
from __future__ import annotations

import torch

from flash_dllm.kernels import _triton


def test_pdl_is_opt_in_and_off_on_the_cpu(monkeypatch):
    x = torch.zeros(2)
    monkeypatch.delenv(_triton.PDL_ENV, raising=False)
    assert _triton.pdl_args(x) == {"PDL": 0, "launch_pdl": False}
    monkeypatch.setenv(_triton.PDL_ENV, "1")          # asked for, but not a CUDA tensor
    assert not _triton.pdl(x)


def test_prefetch_lines_keep_to_the_budget():
    assert _triton.prefetch_lines(10, 32, 3, budget_mb=8) == 4       # the slice, rounded up
    assert _triton.prefetch_lines(10, 32, 1000, budget_mb=8) == 32   # at most 32 lines a row
    # 100 programs x 32 rows x 32 lines x 128 B = 12.5 MiB > 8: halved to 16 lines
    assert _triton.prefetch_lines(100, 32, 40, budget_mb=8) == 16
    assert _triton.prefetch_lines(100, 32, 40, budget_mb=0) == 0
    for programs in (1, 7, 300, 5000):
        n = _triton.prefetch_lines(programs, 16, 64, budget_mb=4)
        assert n == 0 or (n & (n - 1) == 0 and programs * 16 * n * 128 <= 4 * 2 ** 20)


def test_prefetch_budget_from_the_environment(monkeypatch):
    monkeypatch.setenv("FLASH_DLLM_PREFETCH_MB", "0")
    assert _triton.prefetch_lines(10, 32, 3) == 0


def _jit_kernels_with_pdl():
    """(module path, function node) of every jit function in flash_dllm/kernels taking PDL."""
    import ast
    from pathlib import Path
    root = Path(_triton.__file__).parent
    for path in sorted(root.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and any(a.arg == "PDL" for a in node.args.args):
                yield path, tree, node


def test_every_pdl_kernel_waits_before_touching_memory():
    """A kernel launched with PDL must wait for its predecessor before any load or store: the
    statements ahead of its ``pdl_wait(PDL)`` only index (``tl.program_id``, ``tl.arange``, ...)
    or prefetch weights into L2 (``prefetch_l2``, under ``if PDL``: weights no kernel writes)."""
    import ast
    memory = ("load", "store", "atomic_add", "atomic_max", "atomic_xchg", "atomic_cas", "dot")
    found = 0
    for path, _, fn in _jit_kernels_with_pdl():
        if fn.name == "pdl_wait":
            continue
        found += 1
        waited = False
        for stmt in fn.body:
            if ast.unparse(stmt) == "pdl_wait(PDL)":
                waited = True
                break
            for n in ast.walk(stmt):
                if not isinstance(n, ast.Call):
                    continue
                name = ast.unparse(n.func)
                ok = (name.startswith("tl.") and name[3:] not in memory) or name in (
                    "prefetch_l2", "min", "max")
                assert ok, (path.name, fn.name, name)
        assert waited, (path.name, fn.name)
    assert found >= 15


def test_every_pdl_kernel_launch_passes_the_launch_keywords():
    """Each launch ``kernel[grid](...)`` of a PDL kernel passes ``**`` keywords (``pdl_args``, or
    a dict that holds them): a launch without them would miss the PDL constexpr."""
    import ast
    from pathlib import Path
    names = {fn.name for _, _, fn in _jit_kernels_with_pdl()}
    launches = 0
    for path in sorted(Path(_triton.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                    and ast.unparse(node.func.value).split(".")[-1] in names):
                launches += 1
                stars = [k for k in node.keywords if k.arg is None]
                assert stars, (path.name, ast.unparse(node.func.value))
    assert launches >= 15
