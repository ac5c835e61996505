"""What keeps a CPU worker's resident memory flat from step to step: kernel caches bounded, freed memory returned.

Two things grew a worker by about 30 MB a step in bfloat16 (BENCHMARKS.md "Memory flat per step (issue 63)"):
- kernel caches. torch computes bfloat16 products through ideep and oneDNN, which keep one computation (ideep's
  LRU cache, `LRU_CACHE_CAPACITY`) and one kernel (oneDNN's primitive cache, `ONEDNN_PRIMITIVE_CACHE_CAPACITY`)
  per input shape, 1024 of each by default; packed micro-batches change their token count at every micro-batch and
  the rollout its row count at every decode step, so both caches filled with shapes never seen again (a bfloat16
  256x512 product at 391 row counts held 219 MB at the defaults, 34 MB at 64 entries each). Both are read at
  torch's first bfloat16 product, so they belong in the environment a worker starts with: `worker_environment`
  (each variable only where the user has not set it), applied by `worker_memory_settings` around the spawn in
  tlt_cli/processes/local_workers.py, given to the DeepSpeed launcher in tlt_cli/processes/launched_workers.py and
  to `tlt bench update`'s measuring process, and set again by every rank as it joins its process group
  (tlt_cli/processes/distributed.py `init_worker_process`: a rank on another node inherits nothing from tlt).
- glibc malloc's free lists. What the rollout and the update free stays resident in malloc's arenas, scattered, so
  the next phase touches new pages beside it. `return_freed_memory` (malloc_trim(0)) hands the free pages back to
  the kernel; the worker calls it at the end of each phase (tlt_cli/training/memory_parts.py).
`malloc_counts` reads mallinfo2 (what malloc holds in use and free) for the per-part accounting. Where the C library
is not glibc, it gives None and `return_freed_memory` does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cache

# entries of each kernel cache: a step's shapes (forward, both backward products of ~5 weight shapes, for the
# micro-batch at hand and the rollout's few row counts) fit; 1024 held a few hundred MB of shapes never seen again
KERNEL_CACHE_ENTRIES = 64
WORKER_ENVIRONMENT = {
    # ideep's cache of computations, one per shape (torch's bfloat16 matmul and linear on CPU)
    "LRU_CACHE_CAPACITY": str(KERNEL_CACHE_ENTRIES),
    # oneDNN's primitive cache, one kernel per shape
    "ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(KERNEL_CACHE_ENTRIES),
}


def worker_environment(environment: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables a worker should start with for flat memory, leaving out those `environment` (the process's own
    by default) already sets: a user's choice wins."""
    environment = os.environ if environment is None else environment
    return {name: value for name, value in WORKER_ENVIRONMENT.items() if name not in environment}


@contextlib.contextmanager
def worker_memory_settings() -> Iterator[None]:
    """While open, processes started from here inherit `worker_environment()`; this process's own is restored."""
    added = worker_environment()
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


@dataclass(frozen=True)
class MallocCounts:
    """What glibc malloc holds now (mallinfo2), in bytes: in use (small and large chunks), free in its arenas (which
    may be resident), and in chunks it mapped on their own (returned to the kernel when freed)."""

    in_use: int
    free: int
    mapped: int


class _Mallinfo2(ctypes.Structure):
    # struct mallinfo2 of glibc 2.33+ (malloc.h), every field a size_t
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


@cache
def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc with mallinfo2 and malloc_trim, else None."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        library = ctypes.CDLL(name)
        library.mallinfo2.restype = _Mallinfo2
        library.malloc_trim.argtypes = [ctypes.c_size_t]
        library.malloc_trim.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return library


def malloc_counts() -> MallocCounts | None:
    """glibc malloc's counts now, or None without glibc."""
    library = _glibc()
    if library is None:
        return None
    info = library.mallinfo2()
    return MallocCounts(in_use=info.uordblks, free=info.fordblks, mapped=info.hblkhd)


def return_freed_memory() -> bool:
    """Give malloc's free pages back to the kernel (malloc_trim(0), every arena); False without glibc."""
    library = _glibc()
    if library is None:
        return False
    library.malloc_trim(0)
    return True
