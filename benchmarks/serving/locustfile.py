"""Locust load test for `flash-dllm serve` (pip install locust; not a project dependency).

    flash-dllm serve --port 8000 &
    locust -f benchmarks/serving/locustfile.py --host http://127.0.0.1:8000 --headless \
        -u 16 -r 16 -t 60s

Environment: FLASH_DLLM_API_KEY (sent as a bearer token if set), FLASH_DLLM_MAX_TOKENS (default 64),
FLASH_DLLM_STREAM=1 to stream (the time to the first SSE event is reported as "ttft").
"""
from __future__ import annotations

import json
import os
import random
import time

from locust import HttpUser, between, events, task

PROMPTS = [
    "Ivy had 6 shells. She gave 4 to Omar and 2 to Dan. How many shells are left?\n",
    "Tom has 12 apples. He buys 7 more and eats 3. How many apples does he have?\n",
    "A box holds 9 pens. Sam takes 5 pens. How many pens are in the box?\n",
    "def add(a, b):\n",
]
MAX_TOKENS = int(os.environ.get("FLASH_DLLM_MAX_TOKENS", "64"))
STREAM = os.environ.get("FLASH_DLLM_STREAM", "0") == "1"
API_KEY = os.environ.get("FLASH_DLLM_API_KEY")


class DLLMUser(HttpUser):
    wait_time = between(0.0, 0.1)

    def on_start(self) -> None:
        if API_KEY:
            self.client.headers["Authorization"] = f"Bearer {API_KEY}"

    @task(3)
    def completion(self) -> None:
        body = {"prompt": random.choice(PROMPTS), "max_tokens": MAX_TOKENS, "stream": STREAM}
        self._post("/v1/completions", body, "completions")

    @task(1)
    def chat(self) -> None:
        body = {"messages": [{"role": "user", "content": random.choice(PROMPTS)}],
                "max_tokens": MAX_TOKENS, "stream": STREAM}
        self._post("/v1/chat/completions", body, "chat")

    def _post(self, path: str, body: dict, name: str) -> None:
        t0 = time.perf_counter()
        with self.client.post(path, json=body, name=name, stream=STREAM,
                              catch_response=True) as r:
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}: {r.text[:200]}")
                return
            if not STREAM:
                r.success()
                return
            first = True
            for line in r.iter_lines():
                if not line:
                    continue
                if first:
                    events.request.fire(request_type="SSE", name=f"{name} ttft",
                                        response_time=(time.perf_counter() - t0) * 1000,
                                        response_length=0, exception=None, context={})
                    first = False
                if line == b"data: [DONE]":
                    r.success()
                    return
                if b'"error"' in line and "error" in json.loads(line[6:]):
                    r.failure(line.decode()[:200])
                    return
            r.failure("stream ended without [DONE]")
