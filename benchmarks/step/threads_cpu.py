"""CPU threads for a README answer, on an idle machine and next to a busy process (issue 18).

    python3 benchmarks/step/threads_cpu.py --out benchmarks/results/step/threads_cpu.json

Runs ``flash-dllm generate --threads T`` on the README's question for T = 1 and 2, alternating,
``--runs`` times each, first on an idle machine, then with one other process spinning on a core;
records the answer time ``generate`` prints (model load excluded). The default thread count
(``entrypoints/args.choose_threads``) follows from these figures on the 2-core CI machine.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

PROMPT = "Ivy has 23 pens. Vic has 12 fewer than Ivy. How many pens do they have in all?"
_SECONDS = re.compile(r"([0-9.]+) s, finish=")


def answer_seconds(threads: int) -> float:
    r = subprocess.run([sys.executable, "-m", "flash_dllm.cli", "generate", "--threads",
                        str(threads), PROMPT], capture_output=True, text=True, check=True)
    return float(_SECONDS.search(r.stderr).group(1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    a = p.parse_args()
    rows = []
    for busy in (False, True):
        spinner = (subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy
                   else None)
        try:
            times: dict[int, list[float]] = {t: [] for t in a.threads}
            for _ in range(a.runs):
                for t in a.threads:
                    times[t].append(answer_seconds(t))
        finally:
            if spinner is not None:
                spinner.kill()
        for t, xs in times.items():
            rows.append({"busy_neighbour": busy, "threads": t, "seconds": xs,
                         "median_s": statistics.median(xs)})
            print(f"{'busy' if busy else 'idle'} threads {t}: "
                  + ", ".join(f"{x:.2f}" for x in xs) + " s", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"cpus": os.cpu_count(), "prompt": PROMPT,
                                       "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
