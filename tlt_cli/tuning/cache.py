"""The cache of per-machine measurements: what identifies a machine, and one JSON record per key on disk.

A measurement (a linear-form plan, a precision choice) calls `cached_record(cache_dir, folder, key, measure, valid)`
with a `key` that starts from `machine_key(device)` (CPU model string or GPU name, the CPU's AMX and AVX-512
bfloat16 flags, core count, the cores this process may use and its cgroup's CPU quota, torch threads, torch
version, device type) and adds what else the result depends on (the model's shapes, the format of the
record). The record lives at `<cache_dir>/<folder>/<hash of key>.json`; the first caller measures and
writes it (tlt_cli/atomic_files.py: an O_EXCL temporary file, fsynced, then renamed) while holding
`<hash>.lock` (never followed if it is a symbolic link), so concurrent ranks measure once and never read
half a file; a stored record whose key differs (a hash collision, or a file copied from elsewhere) is
measured again. A damaged record counts as absent: a warning names the file and it is measured again. Damaged
is anything tlt_cli/atomic_files.py `read_valid_json` refuses: not a regular file of bounded size (a FIFO, a
link to /dev/zero), not a JSON object, no `key` (a record that names no machine is never trusted), or `valid`
finding its figures out of shape (missing, zero, not finite, outside PLAUSIBLE_FIGURES) or raising on them.
A record that cannot be written (a full disk, a lock file that is a link) is a warning; the run goes on with the
figures it measured. Deleting `<cache_dir>/<folder>/` takes every measurement of it again.

Example:
    key = {**machine_key(torch.device("cpu")), "format": 1, "shapes": shapes}
    record, path = cached_record(cache_dir, "update_precision", key, measure, lambda record: positive_figures(
        record.get("seconds"), ("fp32", "bf16")))
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from pathlib import Path

import torch

from tlt_cli.atomic_files import exclusive_lock, read_valid_json, write_atomically

LOGGER = logging.getLogger(__name__)


# set within `only_cached`: a record that is not cached raises RecordMissing instead of being measured
_ONLY_CACHED: ContextVar[bool] = ContextVar("only_cached", default=False)


class RecordMissing(LookupError):
    """Within `only_cached`: the record of a key is not cached (or is damaged), so it would be measured."""


@contextlib.contextmanager
def only_cached() -> Iterator[None]:
    """Within it `cached_record` gives only cached records, and raises RecordMissing where it would measure: a
    caller holding a model's shapes without its weights (models/loading.py `unloaded_policy`) learns whether it
    must load them (tlt_cli/training/setup.py `decode_plan`)."""
    token = _ONLY_CACHED.set(True)
    try:
        yield
    finally:
        _ONLY_CACHED.reset(token)


# CPU flags that decide how fast low-precision products run (AMX, AVX-512 bfloat16)
MATRIX_FLAGS = ("amx_bf16", "amx_tile", "amx_int8", "avx512_bf16", "avx512_vnni")
# the range of a measured figure (seconds or milliseconds of a pass or an update): a time outside is damage, not a
# measurement (5e-324 would be a free pass, and every ratio to it a division by zero)
PLAUSIBLE_FIGURES = (1e-9, 1e9)
# the CPU time a cgroup v2 may use per period: measurements made under another quota are taken again
CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"


def machine_key(device: torch.device) -> dict:
    """What identifies this machine for a measurement on `device`: processor and its matrix-unit flags, cores (those
    the machine has, those this process may run on, its cgroup's CPU quota), torch threads and version."""
    return {
        "processor": processor_name(device),
        "matrix_flags": list(matrix_flags()) if device.type == "cpu" else [],
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "cpu_quota": cpu_quota(),
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


def cpu_quota() -> str:
    """The cgroup v2 CPU quota of this process ("max 100000": none; "150000 100000": 1.5 cores), or "" where none
    can be read."""
    try:
        return Path(CGROUP_CPU_MAX).read_text().strip()
    except OSError:
        return ""


def record_path(cache_dir: Path, folder: str, key: dict) -> Path:
    """`<cache_dir>/<folder>/<hash of key>.json`: where the record of `key` is cached."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(cache_dir) / folder / f"{digest}.json"


def cached_record(
    cache_dir: Path, folder: str, key: dict, measure: Callable[[], dict], valid: Callable[[dict], bool]
) -> tuple[dict, Path | None]:
    """The record cached for `key` (see the module docstring), or `measure()`'s, written there first; the record
    is `{"key": key, "measure_seconds": ..., **measure()}` and its file's path, None when it could not be cached
    (a warning says why: a full disk, a lock file that is a symbolic link). `valid(record)` says whether a stored
    record's fields have the shape `measure` gives them; one that has not, or does not parse, counts as absent."""
    path = record_path(cache_dir, folder, key)
    with contextlib.ExitStack() as held:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            held.enter_context(exclusive_lock(path.with_suffix(".lock")))
        except OSError as error:
            _warn_uncached(path, error)
            return measured_record(folder, path, key, measure), None
        stored = stored_record(path, key, valid)
        if stored is not None:
            return stored, path
        record = measured_record(folder, path, key, measure)
        try:
            write_atomically(path, json.dumps(record, indent=1) + "\n")
        except OSError as error:  # a full disk: the temporary file is gone, the run goes on
            _warn_uncached(path, error)
            return record, None
    return record, path


def _warn_uncached(path: Path, error: OSError) -> None:
    LOGGER.warning(
        "measurement record %s cannot be written (%s); this run goes on without caching it.",
        path,
        error.strerror or error,
    )


def stored_record(path: Path, key: dict, valid: Callable[[dict], bool]) -> dict | None:
    """The record at `path` if it was measured for `key`; None when there is none, it was measured for another key,
    or it is damaged (unparsable, or fields out of shape: a warning naming the file, it is measured again)."""
    if not os.path.lexists(path):
        return None
    record = read_valid_json(path, lambda record: isinstance(record.get("key"), dict) and record["key"] != key)
    if record is not None:
        return None  # measured for another key (a hash collision, a file copied from elsewhere)
    record = read_valid_json(path, lambda record: record.get("key") == key and valid(record))
    if record is None:
        LOGGER.warning("measurement record %s is damaged (unparsable or out of shape); measuring again.", path)
    return record


def measured_record(folder: str, path: Path, key: dict, measure: Callable[[], dict]) -> dict:
    """`{"key": key, **measure(), "measure_seconds": ...}`; RecordMissing within `only_cached`."""
    if _ONLY_CACHED.get():
        raise RecordMissing(f"{folder} record {path} is not cached")
    LOGGER.info("Measuring %s of this machine into %s (once).", folder, path)
    started = time.perf_counter()
    record = {"key": key, **measure()}
    record["measure_seconds"] = round(time.perf_counter() - started, 2)
    return record


def positive_figures(figures: object, names: Iterable[str]) -> bool:
    """Whether `figures` maps exactly `names` to numbers within PLAUSIBLE_FIGURES (a measured record's timings; an
    integer too large for a float is not one)."""
    low, high = PLAUSIBLE_FIGURES
    return (
        isinstance(figures, dict)
        and set(figures) == set(names)
        and all(
            isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high
            for value in figures.values()
        )
    )
