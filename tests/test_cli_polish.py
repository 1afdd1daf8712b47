"""First-contact polish of the command line (issue 18): one-line errors instead of tracebacks,
thread defaults, help text, bench step's table, the eval progress bar and matrix figure, and
``eval --suite jsonl`` over a user's own file."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flash_dllm import __version__
from flash_dllm.entrypoints import cli
from flash_dllm.entrypoints.args import apply_threads, check_text_arg, choose_threads
from flash_dllm.evals import jsonl
from flash_dllm.models.loader import DEMO_MODEL

ROOT = Path(__file__).resolve().parents[1]


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# ------------------------------------------------------------------------------------ threads
def test_choose_threads_defaults():
    assert choose_threads(3, "cpu", environ={}) == 3                     # --threads wins
    assert choose_threads(None, "cpu", environ={"OMP_NUM_THREADS": "2"}) is None  # torch read it
    assert choose_threads(None, "cuda", environ={}) is None               # GPU: torch's own
    # CPU: half the usable CPUs, at least 1, at most 4 (room for a busy neighbour)
    assert [choose_threads(None, "cpu", environ={}, cpus=c) for c in (1, 2, 3, 8, 64)] == \
        [1, 1, 1, 4, 4]


def test_apply_threads_sets_torch():
    before = torch.get_num_threads()
    try:
        assert apply_threads(1, "cpu") == 1
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_threads_flag_is_validated(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--threads", "0", "hi"])
    assert e.value.code == 2
    assert "--threads: must be an integer >= 1" in capsys.readouterr().err


# ----------------------------------------------------------------------------- help, version
def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"flash-dllm {__version__}"


def test_help_has_no_docstring_markup():
    parser = cli.build_parser()
    texts = [parser.format_help()]
    for sub in cli._subparsers(parser):
        for child in sub.choices.values():
            texts.append(child.format_help())
            for grand in cli._subparsers(child):
                texts.extend(g.format_help() for g in grand.choices.values())
    assert len(texts) > 6
    for t in texts:
        assert "``" not in t and ":class:`" not in t, t[:300]


# ------------------------------------------------------------------ bad input: one-line errors
def _copy_demo(tmp_path: Path) -> Path:
    folder = tmp_path / "ckpt"
    shutil.copytree(DEMO_MODEL, folder)
    return folder


def test_model_path_is_a_file(capsys):
    rc, _, err = run_cli(capsys, "generate", "--model", str(ROOT / "README.md"), "hi")
    assert rc == 2
    assert "is a file, not a checkpoint folder" in err and "Traceback" not in err


def test_config_json_not_an_object(tmp_path, capsys):
    folder = _copy_demo(tmp_path)
    (folder / "config.json").write_text("[1, 2]")
    rc, _, err = run_cli(capsys, "generate", "--model", str(folder), "hi")
    assert rc == 2 and "holds an array, not a JSON object" in err


def test_truncated_safetensors(tmp_path, capsys):
    folder = _copy_demo(tmp_path)
    w = folder / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    rc, _, err = run_cli(capsys, "generate", "--model", str(folder), "hi")
    assert rc == 2
    assert "model.safetensors is not a readable safetensors file" in err
    assert "truncated or corrupt" in err


def test_non_utf8_prompt(capsys):
    bad = os.fsdecode(b"abc\xff")               # what Python makes of a non-UTF-8 argv byte
    rc, _, err = run_cli(capsys, "generate", bad)
    assert rc == 2 and "PROMPT argument is not valid UTF-8 text (byte 0xff at character 3)" in err
    with pytest.raises(ValueError, match="lone surrogate U\\+D800"):
        check_text_arg("x\ud800", "--prompt")
    assert check_text_arg("héllo", "--prompt") == "héllo"


def test_non_utf8_prompt_in_a_real_process():
    """The same from a shell: argv bytes that are not UTF-8 give one line and status 2."""
    r = subprocess.run([sys.executable, "-m", "flash_dllm.cli", "generate", b"abc\xff"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2
    assert r.stderr.strip().startswith("error: the PROMPT argument is not valid UTF-8")
    assert "Traceback" not in r.stderr


def test_bench_serve_url_with_nothing_listening(capsys):
    import socket

    with socket.socket() as s:                        # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc, _, err = run_cli(capsys, "bench", "serve", "--url", f"http://127.0.0.1:{port}",
                         "--requests", "1")
    assert rc == 1
    assert f"no server answers at http://127.0.0.1:{port}" in err
    assert "start one with 'flash-dllm serve'" in err
    rc, _, err = run_cli(capsys, "bench", "serve", "--url", "127.0.0.1:8000")
    assert rc == 2 and "--url must start with http://" in err


def test_ctrl_c_is_one_line(monkeypatch, capsys):
    # fault injection: the command is interrupted while it runs
    from flash_dllm.entrypoints import generate

    def interrupted(_):
        raise KeyboardInterrupt

    monkeypatch.setattr(generate, "run", interrupted)
    rc, _, err = run_cli(capsys, "generate", "hi")
    assert rc == 130 and err.strip() == "error: interrupted (Ctrl-C)"


def test_matrix_without_matplotlib_fails_before_running(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)      # import matplotlib -> ImportError
    rc, _, err = run_cli(capsys, "eval", "--matrix", "--n", "1")
    assert rc == 1
    assert "pip install -e \".[plot]\"" in err


def test_tokenizer_does_not_warn_about_lengths():
    """transformers' sequence-length warning (from tokenizer_config's model_max_length) does
    not reach the user: the engine checks lengths against the model itself."""
    code = ("from flash_dllm.models.tokenizer import Tokenizer; import sys; "
            "t = Tokenizer(sys.argv[1]); assert len(t.encode('x' * 5000)) > 5000")
    r = subprocess.run([sys.executable, "-c", code, str(DEMO_MODEL)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "sequence length" not in r.stderr and "model of type" not in r.stderr


# ---------------------------------------------------------------------------------- bench step
def test_bench_step_prints_each_row_once(capsys, tmp_path):
    out = tmp_path / "step.json"
    rc, stdout, _ = run_cli(capsys, "bench", "step", "--model-shape", "demo", "--device", "cpu",
                            "--prompt-len", "32", "--gen-len", "32", "--block-length", "32",
                            "--batch", "1", "2", "--cache", "dual", "--steps", "2",
                            "--warmup", "1", "--json", str(out))
    assert rc == 0
    rows = [ln for ln in stdout.splitlines() if ln.startswith("batch")]
    assert len(rows) == 2, stdout
    assert json.loads(out.read_text())["rows"][0]["batch"] == 1


# ------------------------------------------------------------------------------ jsonl suite
def _write(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_load_and_errors(tmp_path):
    good = _write(tmp_path / "qa.jsonl", [{"question": "1+1?", "answer": 2}, "",
                                          {"question": "Capital?", "answer": "Paris"}])
    ps = jsonl.load_problems(jsonl.JsonlSpec(str(good)))
    assert [p.meta["target"] for p in ps] == ["2", "Paris"]
    assert ps[1].id == "qa.jsonl:3" and ps[0].prompt == "1+1?\n"
    assert len(jsonl.load_problems(jsonl.JsonlSpec(str(good)), n=1)) == 1

    def err(rows, match, **kw):
        path = _write(tmp_path / "bad.jsonl", rows)
        with pytest.raises(ValueError, match=match):
            jsonl.load_problems(jsonl.JsonlSpec(str(path), **kw))

    err([{"question": "a", "answer": 1}, "{not json"], r"bad.jsonl:2: not valid JSON")
    err(["[1, 2]"], r":1: a line must be a JSON object, got list")
    err([{"q": "a", "answer": 1}], r":1: no field 'question' \(--question-field\); the line "
                                   r"has \['answer', 'q'\]")
    err([{"question": "a", "answer": None}], r"field 'answer' must be a string or a number")
    err([{"question": "", "answer": 1}], r"field 'question' must be a non-empty string")
    err([], r"holds no problems")
    err([{"question": "a", "answer": "no marker"}], r"--gold-regex '#### \(\.\+\)' does not "
                                                    r"match", gold_regex="#### (.+)")
    err([{"question": "a", "answer": 1}], r"--answer-regex '\(' is not a valid regular",
        answer_regex="(")
    (tmp_path / "latin1.jsonl").write_bytes(b'{"question": "caf\xe9", "answer": 1}\n')
    with pytest.raises(ValueError, match="not UTF-8"):
        jsonl.load_problems(jsonl.JsonlSpec(str(tmp_path / "latin1.jsonl")))
    with pytest.raises(FileNotFoundError, match="no such file"):
        jsonl.load_problems(jsonl.JsonlSpec(str(tmp_path / "missing.jsonl")))


@pytest.mark.parametrize("gold, completion, regex, ok", [
    (72, "so she has 70 + 2 = 72 apples.", None, True),          # last number
    (72, "72 apples, not 73", None, False),
    ("1,000", "It costs $1000.", None, True),                    # commas, $, trailing dot
    (2.5, "half of 5 is 2.50", None, True),
    (7, "no number here", None, False),
    ("Paris", "  Paris\n", None, True),                           # text: whole completion
    ("Paris", "It is Paris", None, False),
    ("Paris", "The answer is Paris.", r"answer is (\w+)", True),  # first group
    (72, "#### 72 and later 9", r"#### (-?\d+)", True),           # regex beats last number
    (72, "72 but no marker", r"#### (-?\d+)", False),
])
def test_jsonl_scoring(tmp_path, gold, completion, regex, ok):
    path = _write(tmp_path / "one.jsonl", [{"question": "q", "answer": gold}])
    suite = jsonl.make_suite(jsonl.JsonlSpec(str(path), answer_regex=regex))
    problems = suite.test_problems(None)
    assert suite.score_batch(problems, [completion]) == [ok]


def test_eval_jsonl_end_to_end(tmp_path, capsys):
    """The demo model over a user's file (arith questions written as JSONL, GSM8K-style
    ``#### N`` gold answers) scores like the built-in suite on the same questions."""
    from flash_dllm.evals import arith

    problems = arith.test_problems(4, 0)
    data = _write(tmp_path / "mine.jsonl", [{"q": p.meta["question"], "gold": p.answer}
                                            for p in problems])
    report = tmp_path / "r.json"
    rc, out, err = run_cli(capsys, "eval", "--suite", "jsonl", "--data", str(data),
                           "--question-field", "q", "--answer-field", "gold",
                           "--gold-regex", r"#### (-?\d+)", "--answer-regex", r"#### (-?\d+)",
                           "--cache", "dual", "--decode", "threshold", "--threads", "1",
                           "--json", str(report))
    assert rc == 0, err
    r = json.loads(report.read_text())
    assert r["suite"] == "jsonl" and r["n"] == 4 and r["data"] == str(data)
    assert r["samples"][0]["id"] == "mine.jsonl:1"
    assert r["accuracy"] >= 0.75                   # the demo model solves these
    assert "slots" in err                          # the progress bar ran
    # the same answers through the built-in scorer agree with the jsonl scores
    assert [s["correct"] for s in r["samples"]] == [
        arith.score(p, s["completion"]) for p, s in zip(problems, r["samples"])]


def test_eval_jsonl_flag_errors(tmp_path, capsys):
    rc, _, err = run_cli(capsys, "eval", "--suite", "jsonl")
    assert rc == 2 and "--suite jsonl needs --data FILE" in err
    rc, _, err = run_cli(capsys, "eval", "--suite", "arith", "--data", "x.jsonl")
    assert rc == 2 and "--data only apply to --suite jsonl" in err
    bad = _write(tmp_path / "bad.jsonl", ["{oops"])
    rc, _, err = run_cli(capsys, "eval", "--suite", "jsonl", "--data", str(bad))
    assert rc == 2 and "bad.jsonl:1: not valid JSON" in err


# ------------------------------------------------------------------------- the matrix figure
def test_matrix_figure_axes():
    pytest.importorskip("matplotlib")
    from flash_dllm.evals.report import matrix_figure

    reports = []
    for i, (cache, decode) in enumerate([(c, d) for c in ("none", "prefix", "dual", "flash")
                                         for d in ("vanilla", "threshold", "verify")]):
        reports.append({"suite": "arith", "n": 10, "model": "demo", "device": "cpu",
                        "params": {"cache": cache, "decode": decode},
                        "accuracy": 1.0 if i % 3 else 0.9,
                        "forwards_per_sample": 64.0 if decode == "vanilla" else 3.0 + i % 2,
                        "seconds": 1.0 + i})
    fig = matrix_figure(reports)
    ax_f, ax_s = fig.axes[:2]
    for ax in (ax_f, ax_s):            # room above 100 % for the markers, no tick above it
        lo, hi = ax.get_ylim()
        assert 100.0 < hi <= 106.0 and max(t for t in ax.get_yticks() if lo <= t <= hi) <= 100
    assert ax_f.get_xscale() == "log" and "wall" in ax_s.get_xlabel()
    labels = [t.get_text() for t in ax_f.texts]
    numbers = sorted(int(n) for t in labels for n in t.split(","))
    assert numbers == list(range(1, 13))            # every configuration is labelled once
