"""What a measured choice depends on (this machine), and the file cache every measured choice is kept in.

`machine_key(device)` names the machine a measurement ran on: the CPU's model string (or the GPU's name),
its matrix-unit flags (AMX, avx512_bf16: they decide whether bfloat16 pays), the core count, torch's thread
count and version. `cached_measurement(folder, key, measure)` returns the record stored under `key` in
`folder`, or runs `measure()` and stores its record first: atomically (a temporary file renamed into place)
and under a file lock, so ranks starting together measure once and none reads a half-written file.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

LOGGER = logging.getLogger(__name__)
# CPU flags that decide how fast low-precision products run
MATRIX_FLAGS = ("amx_bf16", "amx_tile", "amx_int8", "avx512_bf16", "avx512_vnni")


def machine_key(device: torch.device) -> dict:
    """What a measurement on `device` depends on besides the model."""
    return {
        "processor": processor_name(device),
        "matrix_flags": list(matrix_flags()) if device.type == "cpu" else [],
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "device": device.type,
    }


def processor_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model string from /proc/cpuinfo (platform.processor() elsewhere)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    for line in _cpuinfo_lines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


def matrix_flags() -> tuple[str, ...]:
    """The CPU's flags among MATRIX_FLAGS (from /proc/cpuinfo; empty where it cannot be read)."""
    for line in _cpuinfo_lines():
        if line.startswith("flags"):
            present = set(line.partition(":")[2].split())
            return tuple(flag for flag in MATRIX_FLAGS if flag in present)
    return ()


def cached_measurement(folder: Path, key: dict, measure: Callable[[], dict]) -> dict:
    """The record cached in `folder` under `key`, or `measure()`'s, written there first (see the module docstring)."""
    path = cache_path(folder, key)
    folder.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)  # released when the file closes
        if path.is_file():
            stored = json.loads(path.read_text())
            if stored.get("key") == key:
                return stored["record"]
        LOGGER.info("Measuring this machine and model into %s (once).", path)
        started = time.perf_counter()
        record = measure()
        stored = {"key": key, "record": record, "measure_seconds": round(time.perf_counter() - started, 2)}
        temporary = folder / f".{path.stem}.tmp-{os.getpid()}"
        temporary.write_text(json.dumps(stored, indent=1) + "\n")
        os.replace(temporary, path)
    return record


def cache_path(folder: Path, key: dict) -> Path:
    """`<folder>/<hash of key>.json`: where the record of `key` is cached."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(folder) / f"{digest}.json"


def _cpuinfo_lines() -> list[str]:
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
