"""Kernel tiles measured on a device by a sweep, kept as data (as vLLM and SGLang keep their tuned
fused-MoE tiles): ``kernels/configs/<kernel>/<device>.json``.

A file holds, per problem key (e.g. ``int8_N12288_K4096_g128``), the best tiles the sweep found
for each row count it measured::

    {"version": 1, "kernel": "quant_gemm", "device": "NVIDIA H100 80GB HBM3",
     "source": "benchmarks/step/sweep_quant_gemm.py ...",
     "configs": {"int8_N12288_K4096_g128": {"32": {"BLOCK_M": 32, ...}, "256": {...}}}}

``lookup`` serves the entry of the smallest measured row count >= M (the largest one past the
end), so a step of M rows runs the tiles measured for the bucket that holds it. A kernel without
a file for the device, or a key no file holds, keeps its own default (``None`` here).
``FLASH_DLLM_KERNEL_CONFIGS`` names a folder searched before the package's, key by key (a
sweep's output before it is committed). Files are read once per folder setting and checked for
their shape here; each kernel checks its own tile names and values (``quant_gemm``). The lookup
is host-side, so it costs nothing in a CUDA graph.

NOTE (batch invariance): tiles that change with M change a row's reduction order with the batch
size, like the defaults they replace; a deterministic mode pins one config (``quant_gemm``).
"""
from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

CONFIG_DIR = Path(__file__).with_name("configs")
ENV = "FLASH_DLLM_KERNEL_CONFIGS"
VERSION = 1


def device_key(name: str) -> str:
    """File stem for a device name: ``NVIDIA H100 80GB HBM3`` -> ``nvidia_h100_80gb_hbm3``."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def config_path(kernel: str, device_name: str, root: Path | str = CONFIG_DIR) -> Path:
    return Path(root) / kernel / f"{device_key(device_name)}.json"


def validate(data: dict, where: str) -> dict:
    """The file's ``configs`` after checking its shape; a ValueError naming ``where`` and the
    field otherwise (a hand-edited file must not fail deep inside a kernel launch)."""
    if not isinstance(data, dict) or data.get("version") != VERSION:
        raise ValueError(f"{where}: expected a JSON object with \"version\": {VERSION}")
    configs = data.get("configs")
    if not isinstance(configs, dict):
        raise ValueError(f"{where}: \"configs\" must be an object of problem keys")
    for key, rows in configs.items():
        if not isinstance(rows, dict) or not rows:
            raise ValueError(f"{where}: configs[{key!r}] must map row counts to tiles")
        for m, cfg in rows.items():
            if not (isinstance(m, str) and m.isdigit() and int(m) > 0):
                raise ValueError(f"{where}: configs[{key!r}] has row count {m!r}, not a "
                                 "positive integer")
            if not isinstance(cfg, dict) or not all(
                    isinstance(v, int) and not isinstance(v, bool) and v >= 0
                    for v in cfg.values()):
                raise ValueError(f"{where}: configs[{key!r}][{m!r}] must map tile names to "
                                 "non-negative integers")
    return configs


def load(kernel: str, device_name: str) -> list[dict]:
    """The ``configs`` tables of ``kernel`` on ``device_name``, the env folder's first, then the
    package's (either may be absent). Read once per (kernel, device, env folder)."""
    return _load(kernel, device_name, os.environ.get(ENV) or None)


@functools.lru_cache(maxsize=None)
def _load(kernel: str, device_name: str, env_dir: str | None) -> list[dict]:
    tables = []
    for root in ([env_dir] if env_dir else []) + [CONFIG_DIR]:
        path = config_path(kernel, device_name, root)
        if path.is_file():
            tables.append(validate(json.loads(path.read_text(encoding="utf-8")), str(path)))
    return tables


def lookup(kernel: str, device_name: str, key: str, M: int) -> dict | None:
    """Tiles for ``key`` at ``M`` rows (a copy) from the first table that holds the key, or None
    (the kernel's default applies)."""
    rows = next((t[key] for t in load(kernel, device_name) if t.get(key)), None)
    if not rows:
        return None
    measured = sorted(int(m) for m in rows)
    pick = next((m for m in measured if m >= M), measured[-1])
    return dict(rows[str(pick)])


def write(path: Path | str, kernel: str, device_name: str, configs: dict, source: str) -> None:
    """A sweep's result as a config file (checked as ``load`` will check it)."""
    data = {"version": VERSION, "kernel": kernel, "device": device_name, "source": source,
            "configs": configs}
    validate(json.loads(json.dumps(data)), str(path))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")
