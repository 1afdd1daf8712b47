"""The newcomer's list (issue 42): what a first user hits in the first hour, each with its test.

The CLI's one-line errors and exit codes (a bad or busy --port, an empty prompt, a missing
tokenizer file, usage errors naming the sub-command), a fast ``--version``, HTTP 400s that say
the real reason (a body that is not UTF-8, a NaN knob, an image input, an empty prompt), the
waiting queue's limit, a failed engine step seen over HTTP, the figures' axes, and a second
Ctrl-C while a stream is in flight.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from conftest import write_tiny_checkpoint
from flash_dllm.config import EngineConfig
from flash_dllm.entrypoints import cli
from flash_dllm.entrypoints.serve import load_async_engine
from flash_dllm.models.loader import DEMO_MODEL
from flash_dllm.server.app import build_app

ROOT = Path(__file__).resolve().parents[1]
CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def usage_error(capsys, *argv: str) -> tuple[int, str]:
    """(exit status, stderr) of a command line argparse refuses."""
    with pytest.raises(SystemExit) as e:
        cli.main(list(argv))
    return e.value.code, capsys.readouterr().err


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("newcomer") / "tiny", "llada")


def make_app(ckpt, config=None, **kw):
    aeng, tok, _ = load_async_engine(ckpt, config=config or EngineConfig(num_kv_pages=64))
    return build_app(aeng, tok, "tiny", **kw), aeng


@pytest.fixture(scope="module")
def app(ckpt):
    return make_app(ckpt)[0]


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                             timeout=60)


def post(app, path, body=None, **kw) -> httpx.Response:
    async def go():
        async with client(app) as c:
            return await (c.post(path, json=body, **kw) if body is not None else
                          c.post(path, **kw))
    return asyncio.run(go())


def sse_events(text: str) -> list:
    return [b[6:] if b[6:] == "[DONE]" else json.loads(b[6:])
            for b in text.split("\n\n") if b.startswith("data: ")]


# ------------------------------------------------------------------------------ 2. --port
@pytest.mark.parametrize("port", ["99999", "-5", "0", "http"])
def test_port_out_of_range_is_a_usage_error(capsys, port):
    rc, err = usage_error(capsys, "serve", "--port", port)
    assert rc == 2
    assert "--port: must be a TCP port number in 1-65535, got" in err


def test_port_in_use_is_one_line_before_the_model_loads(capsys, monkeypatch):
    from flash_dllm.entrypoints import serve

    def never(_):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(serve, "build_server_app", never)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        rc, _, err = run_cli(capsys, "serve", "--port", str(port))
    assert rc == 1
    assert err.strip() == f"error: port {port} is in use on 127.0.0.1"


# ------------------------------------------------------------------- 3. a body not in UTF-8
def test_body_that_is_not_utf8_is_400_naming_the_byte(app):
    r = post(app, CMPL, content=b'{"prompt": "h\xffi", "max_tokens": 2}',
             headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert "not valid UTF-8" in msg and "byte 0xff at offset 13" in msg


# ------------------------------------------------------------------- 4. a missing tokenizer
def test_folder_without_tokenizer_json_is_one_line(tmp_path, capsys):
    folder = tmp_path / "ckpt"
    shutil.copytree(DEMO_MODEL, folder)
    (folder / "tokenizer.json").unlink()
    rc, _, err = run_cli(capsys, "generate", "--model", str(folder), "hi")
    assert rc == 2
    assert err.count("\n") == 1, err
    assert str(folder) in err and "tokenizer.json" in err and "vocab.json" in err
    assert "sentencepiece" not in err and "tiktoken" not in err


# ------------------------------------------------------------------------ 5. wrong reasons
def test_nan_threshold_says_finite(app):
    r = post(app, CMPL, content=b'{"prompt": "hi", "max_tokens": 2, "threshold": NaN}',
             headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "threshold" and "must be a finite number" in err["message"]
    from flash_dllm.config import SamplingParams
    with pytest.raises(ValueError, match="threshold must be a finite number"):
        SamplingParams(threshold=float("inf"))


def test_image_input_is_not_an_unknown_parameter(app):
    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}],
        "max_tokens": 2}
    r = post(app, CHAT, body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert "image inputs are not supported" in err["message"], err
    assert "unknown" not in err["message"] and err["param"] == "messages[0].content[1]"


def test_no_cuda_message_names_the_flag(capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    rc, _, err = run_cli(capsys, "bench", "step", "--device", "cuda")
    assert rc == 2 and "--device cpu" in err and "device='cpu'" not in err


# ------------------------------------------------------------------------ 8. empty prompts
def test_empty_prompt_on_the_command_line(capsys):
    rc, out, err = run_cli(capsys, "generate", "")
    assert rc == 2 and out == ""
    assert err.strip() == "error: the prompt is empty: give some text to continue"
    rc, _, err = run_cli(capsys, "generate", "--chat", "")
    assert rc == 2 and "empty" in err


@pytest.mark.parametrize("path,body", [(CMPL, {"prompt": "", "max_tokens": 2}),
                                       (CMPL, {"prompt": [""], "max_tokens": 2}),
                                       ("/generate", {"prompt": "", "max_new_tokens": 2})])
def test_empty_prompt_over_http(app, path, body):
    r = post(app, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt" and "empty" in err["message"]


# ------------------------------------------------------------------- 6. the waiting queue
def test_max_waiting_one_lets_one_request_wait(ckpt):
    """--max-num-seqs 1 --max-waiting 1, four requests at once: one runs, one waits and is
    served after it, two get 429."""
    app, aeng = make_app(ckpt, EngineConfig(num_kv_pages=64, max_num_seqs=1, max_waiting=1))
    body = {"prompt": "hello there", "max_tokens": 64, "block_length": 32}
    seen_waiting = []

    async def go():
        async with client(app) as c:
            async def watch():
                while True:
                    seen_waiting.append(aeng.num_waiting)
                    await asyncio.sleep(0.005)
            watcher = asyncio.create_task(watch())
            rs = await asyncio.gather(*[c.post(CMPL, json=body) for _ in range(4)])
            watcher.cancel()
            return rs
    rs = asyncio.run(go())
    codes = sorted(r.status_code for r in rs)
    assert codes == [200, 200, 429, 429], [r.text[:200] for r in rs]
    assert 1 in seen_waiting


# ------------------------------------------------------------- 7. --version, usage errors
def test_version_does_not_import_torch():
    code = ("import sys\nfrom flash_dllm.entrypoints.cli import main\n"
            "try:\n    main(['--version'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
            "print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env=ENV)
    assert r.returncode == 0, r.stderr
    version, imported = r.stdout.split()[-3:-1], r.stdout.split()[-1]
    assert version[0] == "flash-dllm" and imported == "False"


def test_unknown_flag_names_the_subcommand(capsys):
    rc, err = usage_error(capsys, "generate", "--bogus", "hi")
    assert rc == 2
    lines = err.strip().splitlines()
    assert lines[0].startswith("usage: flash-dllm generate") and len(lines) == 2, err
    assert lines[1] == "flash-dllm generate: error: unrecognized arguments: --bogus"


def test_bad_choice_is_two_lines(capsys):
    rc, err = usage_error(capsys, "generate", "--decode", "nope", "hi")
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 2, err
    assert lines[0].startswith("usage: flash-dllm generate") and "--help" in lines[0]
    assert "argument --decode: invalid choice: 'nope'" in lines[1]
    rc, err = usage_error(capsys, "bench", "step", "--bogus")
    assert len(err.strip().splitlines()) == 2 and "flash-dllm bench step: error" in err


def test_bench_serve_json_prints_a_summary(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc, stdout, err = run_cli(capsys, "bench", "serve", "--requests", "2", "--concurrency", "1",
                              "--max-tokens", "4", "--no-client-process", "--json", str(out))
    assert rc == 0, err
    report = json.loads(out.read_text())
    assert report["ok"] == 2
    assert not stdout.lstrip().startswith("{") and len(stdout.strip().splitlines()) <= 4, stdout
    assert "2 requests" in stdout and str(out) in stdout + err


# ------------------------------------------------------- a failed engine step, over HTTP
def _fail_next_steps(aeng, times: int) -> None:
    """Fault injection: the runner's next ``times`` steps raise."""
    eng = aeng.engine
    real, left = eng.runner.execute, [times]

    def execute(plan):
        if left[0]:
            left[0] -= 1
            raise RuntimeError("injected fault")
        return real(plan)
    eng.runner.execute = execute


def test_a_failed_step_over_http(ckpt):
    """A failed step fails its request (a 500 error body naming it; a stream's error event then
    [DONE]), the server goes on (/health ok, the next request answers) and /metrics counts it."""
    app, aeng = make_app(ckpt)
    body = {"prompt": "hi", "max_tokens": 8}

    async def go():
        async with client(app) as c:
            _fail_next_steps(aeng, 1)
            plain = await c.post(CMPL, json=body)
            between = await c.post(CMPL, json=body)   # (3 failed steps in a row: a dead engine)
            _fail_next_steps(aeng, 1)
            streamed = await c.post(CMPL, json={**body, "stream": True})
            _fail_next_steps(aeng, 1)
            chat_streamed = await c.post(CHAT, json={"messages": [{"role": "user",
                                                                  "content": "hi"}],
                                                     "max_tokens": 8, "stream": True})
            return (plain, between, streamed, chat_streamed, await c.get("/health"),
                    await c.post(CMPL, json=body), await c.get("/metrics"))
    plain, between, streamed, chat_streamed, health, after, metrics = asyncio.run(go())
    assert plain.status_code == 500, plain.text
    err = plain.json()["error"]
    assert err["type"] == "server_error" and err["code"] == "request_failed"
    assert "injected fault" in err["message"]
    for r in (streamed, chat_streamed):
        assert r.status_code == 200
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        assert "injected fault" in events[-2]["error"]["message"], events[-2]
        assert events[-2]["error"]["code"] == "request_failed"
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert after.status_code == between.status_code == 200
    assert "flash_dllm_failed_steps_total 3.0" in metrics.text


# ------------------------------------------------------------- 1. a second Ctrl-C mid-stream
@pytest.mark.slow
def test_second_sigint_while_streaming_exits_at_once_and_cleanly(tmp_path):
    """Two SIGINTs while a long stream is in flight: the client's stream ends with an error
    event then [DONE], the process exits within seconds with status 130 (interrupted), and
    nothing aborts (no SIGABRT, no traceback)."""
    import signal
    import threading
    import time

    from flash_dllm.bench.serve import free_port

    ckpt = write_tiny_checkpoint(tmp_path / "tiny", "llada", max_sequence_length=2048)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "flash_dllm", "serve", "--model", str(ckpt),
                             "--port", str(port), "--log-level", "warning"], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    got: dict = {}

    def stream():
        try:
            with httpx.stream("POST", url + CMPL, json={"prompt": "long one", "max_tokens": 1024,
                                                        "block_length": 32, "stream": True},
                              timeout=60) as r:
                got["lines"] = [ln for ln in r.iter_lines() if ln]
        except httpx.HTTPError as e:
            got["error"] = repr(e)

    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None and time.monotonic() < deadline
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        t = threading.Thread(target=stream)
        t.start()
        while "flash_dllm_requests_running 1.0" not in httpx.get(url + "/metrics").text:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        t_second = time.monotonic()
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=30)
        exited_after = time.monotonic() - t_second
        t.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = proc.stdout.read().decode(errors="replace")
    assert rc == 130, (rc, out)
    assert exited_after < 10
    assert "Traceback" not in out and "terminate called" not in out, out
    assert "error" not in got, got
    lines = got["lines"]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["error"]["code"] == "interrupted"


# ------------------------------------------------------------ 9. figures with perfect scores
def _matrix_reports(acc):
    return [{"suite": "arith", "n": 10, "model": "demo", "device": "cpu",
             "params": {"cache": c, "decode": d}, "accuracy": acc(i),
             "forwards_per_sample": 64.0 if d == "vanilla" else 3.0 + i % 2, "seconds": 1.0 + i}
            for i, (c, d) in enumerate([(c, d) for c in ("none", "prefix", "dual", "flash")
                                        for d in ("vanilla", "threshold", "verify")])]


def test_matrix_figure_when_every_accuracy_is_100():
    """Every configuration at 100 %: the y-axis spans more than a sliver, with room above the
    top tick for the markers and their labels; no tick reads above 100; the axis label and every
    point label lie inside the figure and inside their axes, none overlapping another."""
    pytest.importorskip("matplotlib")
    from flash_dllm.evals.report import matrix_figure

    fig = matrix_figure(_matrix_reports(lambda i: 1.0))
    fig.canvas.draw()                        # as savefig does: the layout is final
    renderer = fig.canvas.get_renderer()
    whole = fig.bbox
    for ax in fig.axes[:2]:
        lo, hi = ax.get_ylim()
        assert hi > 100 and hi - lo >= 10, (lo, hi)
        assert max(t for t in ax.get_yticks() if lo <= t <= hi) <= 100
        label = ax.yaxis.label.get_window_extent(renderer)
        assert label.x0 >= whole.x0 and label.y0 >= whole.y0, "the y label is clipped"
        frame = ax.get_window_extent(renderer)
        boxes = [t.get_window_extent(renderer) for t in ax.texts]
        assert boxes
        for i, b in enumerate(boxes):
            assert frame.x0 <= b.x0 and b.x1 <= frame.x1 and frame.y0 <= b.y0 \
                and b.y1 <= frame.y1, ax.texts[i].get_text()
            assert not any(b.overlaps(o) for o in boxes[i + 1:]), ax.texts[i].get_text()


@pytest.mark.slow
def test_a_second_sigterm_after_the_drain_changes_nothing(tmp_path):
    """SIGTERM on an idle server, then another one while it exits: the drain had nothing to
    wait for, so the process still exits 0 (it used to die of the second signal's default
    action, status -15, once uvicorn had put the original handlers back)."""
    import signal
    import time

    from flash_dllm.bench.serve import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "flash_dllm", "serve", "--port", str(port),
                             "--log-level", "warning"], env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None and time.monotonic() < deadline
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        codes = []
        for delay in (0.5, 1.0):    # the second signal lands while the process winds down
            proc.send_signal(signal.SIGTERM)
            time.sleep(delay)
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            codes.append(proc.wait(30))
            if delay == 0.5:        # a fresh server for the second timing
                proc = subprocess.Popen(proc.args, env=ENV, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
                while True:
                    assert proc.poll() is None and time.monotonic() < deadline + 60
                    try:
                        if httpx.get(f"http://127.0.0.1:{port}/ready",
                                     timeout=2).status_code == 200:
                            break
                    except httpx.TransportError:
                        time.sleep(0.1)
        assert codes == [0, 0], codes
    finally:
        if proc.poll() is None:
            proc.kill()
