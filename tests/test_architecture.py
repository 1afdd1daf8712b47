"""The package's shape, checked from its source: no import cycles, layers import downwards, no
module past ~400 lines without a written reason, and ``Engine.step`` short enough to read as the
schedule -> execute -> apply it is (docs/architecture.md)."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "flash_dllm"
MAX_LINES = 400
# a module past MAX_LINES says why in its first lines (the docstring), with this marker
SIZE_REASON = "NOTE (size)"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every ``flash_dllm`` module ``name`` imports, at any depth of its code (function-level
    imports count too: a cycle broken by a late import is still a cycle of the design)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {n: _imports(n, p, mods) for n, p in mods.items()}


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                cycles.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


# lower layers never import higher ones (DESIGN: imports point down only). From the top:
# entrypoints > server > disagg > engine > worker > cache.io > decoding > core > config > cache >
# models > layers > kernels (distributed beside them). A module obeys the rule of the longest
# listed package that holds it (cache.io, not cache).
_TOP = ("flash_dllm.server", "flash_dllm.entrypoints")
FORBIDDEN = {
    "flash_dllm.kernels": ("flash_dllm.layers", "flash_dllm.models", "flash_dllm.engine",
                           "flash_dllm.worker", "flash_dllm.core", "flash_dllm.cache",
                           "flash_dllm.decoding", "flash_dllm.disagg") + _TOP,
    "flash_dllm.layers": ("flash_dllm.engine", "flash_dllm.worker", "flash_dllm.core",
                          "flash_dllm.disagg", "flash_dllm.models") + _TOP,
    "flash_dllm.models": ("flash_dllm.engine", "flash_dllm.worker", "flash_dllm.core",
                          "flash_dllm.disagg") + _TOP,
    "flash_dllm.cache": ("flash_dllm.engine", "flash_dllm.worker", "flash_dllm.core",
                         "flash_dllm.disagg", "flash_dllm.decoding", "flash_dllm.layers",
                         "flash_dllm.models") + _TOP,
    # KV movement between tiers and overflow streaming build attention metadata (layers)
    "flash_dllm.cache.io": ("flash_dllm.engine", "flash_dllm.worker", "flash_dllm.disagg") + _TOP,
    "flash_dllm.core": ("flash_dllm.engine", "flash_dllm.worker", "flash_dllm.disagg",
                        "flash_dllm.decoding", "flash_dllm.cache.io", "flash_dllm.layers",
                        "flash_dllm.models") + _TOP,
    "flash_dllm.decoding": ("flash_dllm.engine", "flash_dllm.worker", "flash_dllm.disagg",
                            "flash_dllm.cache.io") + _TOP,
    "flash_dllm.worker": ("flash_dllm.engine", "flash_dllm.disagg") + _TOP,
    "flash_dllm.engine": ("flash_dllm.disagg", "flash_dllm.evals", "flash_dllm.bench") + _TOP,
    "flash_dllm.disagg": ("flash_dllm.evals", "flash_dllm.bench") + _TOP,
    "flash_dllm.server": ("flash_dllm.entrypoints", "flash_dllm.evals", "flash_dllm.bench"),
    "flash_dllm.evals": ("flash_dllm.entrypoints", "flash_dllm.server"),
    "flash_dllm.bench": ("flash_dllm.entrypoints",),
}


def _rule(mod: str) -> tuple[str, ...]:
    """The banned imports of ``mod``: those of the longest FORBIDDEN package holding it."""
    holders = [p for p in FORBIDDEN if mod == p or mod.startswith(p + ".")]
    return FORBIDDEN[max(holders, key=len)] if holders else ()


def test_layers_import_downwards():
    bad = []
    for mod, deps in _graph().items():
        banned = _rule(mod)
        bad += [f"{mod} -> {d}" for d in deps
                if any(d == b or d.startswith(b + ".") for b in banned)]
    assert not bad, "imports that point up:\n" + "\n".join(sorted(bad))


def test_nothing_below_server_knows_http_and_cache_never_touches_cuda():
    for name, path in _modules().items():
        text = path.read_text(encoding="utf-8")
        if not name.startswith(("flash_dllm.server", "flash_dllm.entrypoints",
                                "flash_dllm.bench")):
            assert "fastapi" not in text and "starlette" not in text, name
        if (name.startswith(("flash_dllm.cache", "flash_dllm.decoding"))
                and not name.startswith("flash_dllm.cache.io")):     # (io moves bytes: CUDA)
            # placement and decoding are host logic: torch.cuda.is_available() is the only use
            for line in text.splitlines():
                assert "torch.cuda." not in line or "torch.cuda.is_available()" in line, \
                    f"{name}: {line.strip()}"


def test_modules_are_small_or_say_why():
    big = []
    for name, path in _modules().items():
        text = path.read_text(encoding="utf-8")
        n = text.count("\n")
        doc = ast.get_docstring(ast.parse(text)) or ""
        if n > MAX_LINES and SIZE_REASON not in doc:
            big.append(f"{name}: {n} lines")
    assert not big, (f"modules over {MAX_LINES} lines without a '{SIZE_REASON}' reason in their "
                     "docstring:\n" + "\n".join(big))


def test_engine_step_reads_as_schedule_execute_apply():
    from flash_dllm.engine.engine import Engine
    src = inspect.getsource(Engine.step)
    assert src.count("\n") < 25
    for call in ("self.scheduler.schedule()", "self.runner.execute(plan)", "self._apply("):
        assert call in src


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_exists(layer):
    assert (PKG.parent / layer.replace(".", "/")).is_dir(), f"{layer} does not exist"


# --- the extension seams (issue 38): no feature is a branch on a mode name in the step path
MODE_FREE = ("flash_dllm.decoding", "flash_dllm.cache", "flash_dllm.config", "flash_dllm.models",
             "flash_dllm.bench", "flash_dllm.evals")
STEP_PATH = ("flash_dllm.core", "flash_dllm.engine", "flash_dllm.worker")
MODE_FIELDS = ("decode", "cache")


def _is_string(node) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and bool(node.elts) and all(
        isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts)


def _is_mode(node) -> bool:
    """``x.decode`` / ``x.cache`` or a variable named ``decode`` / ``cache``."""
    return ((isinstance(node, ast.Attribute) and node.attr in MODE_FIELDS)
            or (isinstance(node, ast.Name) and node.id in MODE_FIELDS))


def mode_comparisons() -> list[str]:
    """Every comparison of a decode policy's or cache mode's name with a string literal
    (``p.cache == "dual"``, ``decode not in ("vanilla", "threshold")``), outside the modules
    that define the modes."""
    hits = []
    for name, path in sorted(_modules().items()):
        if name.startswith(MODE_FREE):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Compare):
                ops = [node.left, *node.comparators]
                if any(_is_mode(o) for o in ops) and any(_is_string(o) for o in ops):
                    hits.append(f"{name}:{node.lineno}")
    return hits


def test_no_mode_name_is_compared_in_the_step_path():
    hits = mode_comparisons()
    assert not [h for h in hits if h.startswith(STEP_PATH)], hits
    assert len(hits) <= 3, hits


def test_the_mode_comparison_check_sees_comparisons():
    tree = ast.parse('if p.cache not in ("dual", "prefix") or decode == "verify": pass\n'
                     'if t.decode == w.rank or level == "none": pass')
    found = [n for n in ast.walk(tree) if isinstance(n, ast.Compare)
             and any(_is_mode(o) for o in [n.left, *n.comparators])
             and any(_is_string(o) for o in [n.left, *n.comparators])]
    assert len(found) == 2


HARD_MAX_LINES = 500
MAX_LONG_FUNCTIONS, LONG_FUNCTION = 3, 80


def test_no_module_over_500_lines():
    big = [f"{name}: {path.read_text(encoding='utf-8').count(chr(10))} lines"
           for name, path in _modules().items()
           if path.read_text(encoding="utf-8").count("\n") > HARD_MAX_LINES]
    assert not big, big


def test_few_long_functions():
    long = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > LONG_FUNCTION:
                    long.append(f"{name}.{node.name}: {n} lines")
    assert len(long) <= MAX_LONG_FUNCTIONS, sorted(long)
