"""Adapters to third-party tools; each module imports its tool only when it is itself imported.

- ``lm_eval``: the ``flash-dllm`` model for lm-evaluation-harness (``pip install lm-eval``);
  run it with ``python -m flash_dllm.integrations.lm_eval --model flash-dllm ...``.
"""
