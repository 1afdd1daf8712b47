"""``python -m flash_dllm``: the ``flash-dllm`` command."""
import sys

from flash_dllm.entrypoints.cli import main

sys.exit(main())
