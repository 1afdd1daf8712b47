"""``python -m flash_dllm.cli``: the ``flash-dllm`` command (``flash_dllm.entrypoints.cli``)."""
import sys

from flash_dllm.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main())
