"""A worker's memory hygiene and per-part accounting (tlt_cli/memory_hygiene.py, tlt_cli/training/memory_parts.py):
the kernel caches' bounds reach a worker tlt starts, malloc_trim gives freed pages back, the parts add up to what
is reported, and a peak past the estimate gets one warning naming the part that grew."""

import ctypes
import os
import subprocess
import sys

import pytest
import torch

from tlt_cli import memory_hygiene
from tlt_cli.memory_hygiene import WORKER_ENVIRONMENT, return_freed_memory, worker_environment
from tlt_cli.processes.local_workers import LocalWorkers
from tlt_cli.training import memory, memory_parts
from tlt_cli.training.memory_parts import MemoryWatch, measure_parts

MB = 2**20
glibc = pytest.mark.skipif(memory_hygiene.malloc_counts() is None, reason="needs glibc's mallinfo2 and malloc_trim")


class RankSpec:
    """What LocalWorkers hands each process: anything with for_rank (picklable, for the spawn)."""

    def for_rank(self, address):
        return address.rank


def report_environment(rank, events):
    """A worker body: send the memory variables this spawned process started with."""
    events.put({name: os.environ.get(name) for name in WORKER_ENVIRONMENT})


def test_a_worker_tlt_starts_has_the_kernel_cache_bounds_and_a_users_own_value_wins(monkeypatch):
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")
    workers = LocalWorkers(RankSpec(), 1, [], report_environment)
    try:
        seen = workers.next_event(timeout=120)
    finally:
        workers.stop()
    assert seen == {"LRU_CACHE_CAPACITY": "7", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"}
    # the driver's own environment is as it was
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in os.environ and os.environ["LRU_CACHE_CAPACITY"] == "7"


def test_worker_environment_leaves_out_what_is_set():
    assert worker_environment({}) == WORKER_ENVIRONMENT
    assert worker_environment({"LRU_CACHE_CAPACITY": "1"}) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"}


@glibc
def test_return_freed_memory_gives_back_freed_pages_below_a_live_chunk():
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    chunks = [libc.malloc(4096) for _ in range(25_000)]  # ~100 MB of small chunks, below the mmap threshold
    for chunk in chunks:
        ctypes.memset(chunk, 1, 4096)
    for chunk in chunks[:-1]:  # the last stays: the freed pages lie below it, so free() alone cannot return them
        libc.free(chunk)
    before = memory.resident_bytes()
    assert return_freed_memory()
    assert before - memory.resident_bytes() > 50 * MB
    libc.free(chunks[-1])


def small_model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 256)).sum().backward()
    optimizer.step()
    return model, optimizer


@glibc
def test_the_parts_add_up_to_the_resident_set_and_tensors_land_with_their_owner():
    model, optimizer = small_model_and_optimizer()
    drafter = torch.nn.Linear(64, 64)
    kept = torch.ones(3 * MB // 4)  # 3 MB that no owner holds
    before = memory.resident_bytes()
    parts = measure_parts(model, optimizer, drafter)
    after = memory.resident_bytes()
    weights = sum(parameter.numel() * 4 for parameter in model.parameters())
    assert parts.policy_weights == parts.gradients == weights  # the drafter has no gradients
    assert parts.drafter == sum(parameter.numel() * 4 for parameter in drafter.parameters())
    # AdamW's two moments per weight, and its step counters
    assert 2 * weights <= parts.optimizer < 2 * weights + 1024
    assert parts.other_tensors >= kept.numel() * 4
    assert min(before, after) - MB <= parts.resident_bytes <= max(before, after) + MB
    metrics = parts.metrics()
    assert set(metrics) == {f"memory_{name}_gb" for name in memory_parts.PART_NAMES}
    assert sum(metrics.values()) == pytest.approx(parts.resident_bytes / memory.GB)


@glibc
def test_a_peak_past_the_estimate_warns_once_naming_the_part_that_grew(monkeypatch):
    model, optimizer = small_model_and_optimizer()
    trims = []
    monkeypatch.setattr(memory_parts, "return_freed_memory", lambda: trims.append(1))
    estimate = memory.resident_bytes()
    watch = MemoryWatch(estimate, model, optimizer, None)
    watch.phase_end()
    metrics = watch.step_end(0, rollout_peak=estimate, update_peak=estimate)
    assert watch.take_warnings() == [] and metrics["memory_returned_gb"] == pytest.approx(0, abs=0.05)
    grown = torch.ones(64 * MB // 4)
    watch.step_end(1, rollout_peak=estimate, update_peak=int(estimate * 1.3))
    (warning,) = watch.take_warnings()
    assert warning.startswith("step 1: the resident peak") and "by 30%" in warning
    assert "the part that grew most since the first step: other tensors" in warning
    watch.step_end(2, rollout_peak=int(estimate * 2), update_peak=0)
    assert watch.take_warnings() == [] and len(trims) == 4  # after each phase and each step
    del grown


BOUNDED_PRODUCTS = """
import torch
from tlt_cli.memory_hygiene import malloc_counts
torch.set_num_threads(1)
weight = torch.randn(256, 512, dtype=torch.bfloat16)
torch.randn(8, 256, dtype=torch.bfloat16) @ weight
before = malloc_counts().in_use
for rows in range(9, 400):
    torch.randn(rows, 256, dtype=torch.bfloat16) @ weight
print((malloc_counts().in_use - before) / 2**20)
"""


@glibc
def test_bfloat16_products_of_many_shapes_hold_little_in_a_workers_environment():
    """391 row counts of one bfloat16 product: ideep and oneDNN kept one computation each (219 MB on an AMX Xeon at
    their defaults); bounded as a worker starts, 34 MB."""
    environment = {**{key: value for key, value in os.environ.items() if key not in WORKER_ENVIRONMENT}}
    environment.update(worker_environment(environment))
    result = subprocess.run(
        [sys.executable, "-c", BOUNDED_PRODUCTS], capture_output=True, text=True, env=environment, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert float(result.stdout.strip().splitlines()[-1]) < 100  # 64 entries of about 0.5 MB each
