"""The README's examples that ask the default (demo) model a question, run as a user would, must
give a sensible answer (issue 17): the quick start's generate, the Python API block that uses the
demo, every curl example of the README and of docs/serving.md against a real server (over the real
``curl``), and the proxy example of checkpoints/README.md.

The examples are read from the READMEs at test time, so an edited example is the one tested. Each
question must have a check below (a new one fails until it gets one). Examples that need a
checkpoint the project cannot ship (``--model DIR``, ``path/to/...``) or a GPU are not run.
"""
from __future__ import annotations

import ast
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _blocks(path: Path, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S)


def _final(text: str) -> int | None:
    m = re.search(r"####\s*(-?\d+)\s*$", text.strip())
    return int(m.group(1)) if m else None


def _defines(text: str, name: str, arg, want) -> bool:
    """``text`` defines function ``name`` and ``name(arg) == want`` (run in a fresh namespace;
    demo-model answers are one-line pure functions)."""
    ns: dict = {}
    try:
        exec(compile(text, "<answer>", "exec"), ns)      # noqa: S102 - our own model's answer
        return ns[name](arg) == want
    except Exception:  # noqa: BLE001 - a wrong answer is a failed check, not an error
        return False


# question (a substring of it) -> check of the answer text
CHECKS = {
    "Ivy has 23 pens. Vic has 12 fewer than Ivy": lambda t: _final(t) == 34,
    "A jar has 2 cookies. Amy adds 22 more, then takes out 5": lambda t: _final(t) == 19,
    "Write a Python function calc(s) that reverses the string s": (
        lambda t: _defines(t, "calc", "abc", "cba")),
    "Write a Python function f(n) that returns n plus 3": lambda t: _defines(t, "f", 4, 7),
    "Mia has 23 marbles. She buys 14 more": lambda t: _final(t) == 92,
}


def _check(question: str, answer: str) -> None:
    keys = [k for k in CHECKS if k in question]
    assert keys, f"README example {question!r} has no check in {__file__}: add one"
    assert CHECKS[keys[0]](answer), f"README example {question!r} -> {answer!r}"


def test_quick_start_generate():
    (block,) = [b for b in _blocks(ROOT / "README.md", "bash") if "flash-dllm generate" in b][:1]
    cmd = block[block.index("flash-dllm generate"):].strip()
    args = shlex.split(cmd)[2:]
    r = subprocess.run([sys.executable, "-m", "flash_dllm", "generate", *args],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    _check(args[-1], r.stdout)


def test_python_api_demo_block():
    (block,) = [b for b in _blocks(ROOT / "README.md", "python") if "LLM()" in b]
    tree = ast.parse("from flash_dllm import LLM, SamplingParams\n" + block)
    last = tree.body[-1]
    assert isinstance(last, ast.Expr), "the demo block ends with the generate call"
    tree.body[-1] = ast.Assign(targets=[ast.Name("result", ast.Store())], value=last.value)
    ast.fix_missing_locations(tree)
    ns: dict = {}
    exec(compile(tree, "README.md", "exec"), ns)          # noqa: S102 - the README's own code
    prompts = last.value.args[0]
    questions = [ast.literal_eval(p) for p in prompts.elts]
    assert len(ns["result"]) == len(questions) >= 2
    for q, out in zip(questions, ns["result"]):
        _check(q, out.text)


def test_proxy_example_of_checkpoints_readme():
    (block,) = [b for b in _blocks(ROOT / "checkpoints" / "README.md", "bash")
                if "flash-dllm generate" in b]
    cmd = block[block.index("flash-dllm generate"):].split("\nflash-dllm eval")[0]
    args = shlex.split(cmd.replace("\\\n", " "))[2:]
    r = subprocess.run([sys.executable, "-m", "flash_dllm", "generate", *args],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    _check(args[args.index("--prompt") + 1], r.stdout)


@pytest.fixture(scope="module")
def demo_server():
    pytest.importorskip("fastapi")
    from flash_dllm.bench.serve import InProcessServer
    from flash_dllm.entrypoints.serve import load_async_engine
    from flash_dllm.server.app import build_app

    aeng, tok, folder = load_async_engine()
    with InProcessServer(build_app(aeng, tok, folder.name), aeng) as srv:
        yield srv


def _curl_commands(path: Path) -> list[str]:
    cmds = []
    for block in _blocks(path, "bash"):
        if "curl -s" not in block or "localhost:8000" not in block:
            continue
        parts = re.split(r"\n(?=curl )", block.strip())
        cmds += [p for p in parts if p.startswith("curl ") and "localhost:8000" in p]
    return cmds


def test_every_curl_example_answers_sensibly(demo_server):
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    readme = _curl_commands(ROOT / "README.md")
    assert readme, "the README shows the server answering a question (a curl example)"
    # the README's own first, then the serving page's (an example on both pages runs once)
    cmds = list(dict.fromkeys(readme + _curl_commands(ROOT / "docs" / "serving.md")))
    assert len(cmds) >= 5, cmds
    port = demo_server.url.rsplit(":", 1)[1]
    seen = set()
    for cmd in cmds:
        r = subprocess.run(["bash", "-c", cmd.replace("localhost:8000", f"127.0.0.1:{port}")],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, (cmd, r.stderr)
        out = r.stdout
        if "/metrics" in cmd:
            assert re.search(r"^flash_dllm_\w+", out, flags=re.M), out[:500]
            seen.add("metrics")
            continue
        body = json.loads(re.search(r"-d '(.*?)'", cmd, flags=re.S).group(1))
        question = body.get("prompt") or body["messages"][-1]["content"]
        if body.get("stream"):
            events = [line[6:] for line in out.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]", events[-3:]
            chunks = [json.loads(e) for e in events[:-1]]
            assert chunks[-1]["usage"]["completion_tokens"] > 0   # include_usage: usage last
            text = "".join(c["choices"][0]["delta"].get("content") or ""
                           for c in chunks if c["choices"])
        else:
            resp = json.loads(out)
            if "/generate" in cmd:
                text = resp["text"]
            elif "/chat/" in cmd:
                text = resp["choices"][0]["message"]["content"]
            else:
                text = resp["choices"][0]["text"]
        _check(question, text)
        seen.add(cmd.split()[2].split(":8000", 1)[1])           # the endpoint's path
    assert {"/v1/completions", "/v1/chat/completions", "/generate", "metrics"} <= seen, seen
