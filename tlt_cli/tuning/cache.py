"""The cache of per-machine measurements: what identifies a machine, and one JSON record per key on disk.

A measurement (a linear-form plan, a precision choice) calls `cached_record(cache_dir, folder, key, measure)`
with a `key` that starts from `machine_key(device)` (CPU model string or GPU name, the CPU's AMX and AVX-512
bfloat16 flags, core count, torch
threads, torch version, device type) and adds what else the result depends on (the model's shapes, the
format of the record). The record lives at `<cache_dir>/<folder>/<hash of key>.json`; the first caller
measures and writes it (to a temporary file, then renamed) while holding `<hash>.lock`, so concurrent
ranks measure once and never read half a file; a stored record whose key differs (a hash collision, or
a file copied from elsewhere) is measured again.

Example:
    key = {**machine_key(torch.device("cpu")), "format": 1, "shapes": shapes}
    record, path = cached_record(cache_dir, "rollout_precision", key, lambda: {"dtype": measure_dtype()})
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


# CPU flags that decide how fast low-precision products run (AMX, AVX-512 bfloat16)
MATRIX_FLAGS = ("amx_bf16", "amx_tile", "amx_int8", "avx512_bf16", "avx512_vnni")


def machine_key(device: torch.device) -> dict:
    """What identifies this machine for a measurement on `device`: processor and its matrix-unit flags, cores,
    torch threads and version."""
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
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


def matrix_flags() -> tuple[str, ...]:
    """The CPU's flags among MATRIX_FLAGS (from /proc/cpuinfo; empty where it cannot be read)."""
    cpuinfo = Path("/proc/cpuinfo")
    for line in cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []:
        if line.startswith("flags"):
            present = set(line.partition(":")[2].split())
            return tuple(flag for flag in MATRIX_FLAGS if flag in present)
    return ()


def record_path(cache_dir: Path, folder: str, key: dict) -> Path:
    """`<cache_dir>/<folder>/<hash of key>.json`: where the record of `key` is cached."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(cache_dir) / folder / f"{digest}.json"


def cached_record(cache_dir: Path, folder: str, key: dict, measure: Callable[[], dict]) -> tuple[dict, Path]:
    """The record cached for `key` (see the module docstring), or `measure()`'s, written there first; the record
    is `{"key": key, "measure_seconds": ..., **measure()}`."""
    path = record_path(cache_dir, folder, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)  # released when the file closes
        if path.is_file():
            stored = json.loads(path.read_text())
            if stored.get("key") == key:
                return stored, path
        LOGGER.info("Measuring %s of this machine into %s (once).", folder, path)
        started = time.perf_counter()
        record = {"key": key, **measure()}
        record["measure_seconds"] = round(time.perf_counter() - started, 2)
        temporary = path.parent / f".{path.stem}.tmp-{os.getpid()}"
        temporary.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(temporary, path)
    return record, path
