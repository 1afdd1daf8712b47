"""Entry points: ``EngineArgs`` and ``load_engine`` (one way to build an engine), the ``LLM``
Python API, and the ``flash-dllm`` command line (``cli``)."""
