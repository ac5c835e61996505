"""The cache of per-machine measurements (tlt_cli/tuning/cache.py): one record per key, measured once even by
concurrent processes, measured again when the key changes."""

import json
import multiprocessing
import time

import torch

from tlt_cli.tuning import cache
from tlt_cli.tuning.cache import cached_record, machine_key, record_path

FOLDER = "example_choice"


def counted_measure(log_path, seconds: float = 0.0):
    """A measurement that appends one line to log_path each time it runs (how often it ran is the count) and
    takes `seconds`."""

    def measure() -> dict:
        with open(log_path, "a") as log:
            log.write("measured\n")
        time.sleep(seconds)
        return {"choice": "fast"}

    return measure


def has_choice(record: dict) -> bool:
    return record.get("choice") == "fast"


def test_a_record_is_measured_once_per_key_and_again_when_the_key_changes(tmp_path, monkeypatch):
    log = tmp_path / "log"
    key = {**machine_key(torch.device("cpu")), "format": 1}
    record, path = cached_record(tmp_path, FOLDER, key, counted_measure(log), has_choice)
    assert record["choice"] == "fast" and record["key"] == key and "measure_seconds" in record
    assert path == record_path(tmp_path, FOLDER, key) and path.parent.name == FOLDER
    assert json.loads(path.read_text()) == record
    assert cached_record(tmp_path, FOLDER, key, counted_measure(log), has_choice) == (record, path)
    assert log.read_text().count("measured") == 1
    monkeypatch.setattr(cache, "processor_name", lambda device: "Another CPU")
    other_key = {**machine_key(torch.device("cpu")), "format": 1}
    assert other_key["processor"] == "Another CPU"
    assert cached_record(tmp_path, FOLDER, other_key, counted_measure(log), has_choice)[1] != path
    stored = json.loads(path.read_text())
    stored["key"]["torch"] = "0.0"  # a file at this name written for another key is measured again
    path.write_text(json.dumps(stored))
    cached_record(tmp_path, FOLDER, key, counted_measure(log), has_choice)
    assert log.read_text().count("measured") == 3 and json.loads(path.read_text())["key"] == key
    assert sorted(entry.suffix for entry in path.parent.iterdir()) == [".json", ".json", ".lock", ".lock"]


def measure_in_process(cache_dir, log_path, key) -> None:
    cached_record(cache_dir, FOLDER, key, counted_measure(log_path, seconds=0.5), has_choice)


def test_concurrent_processes_measure_once(tmp_path):
    log, key = tmp_path / "log", {"format": 1, "shapes": {"8x8 float32": 2}}
    context = multiprocessing.get_context("fork")
    processes = [context.Process(target=measure_in_process, args=(tmp_path, log, key)) for _ in range(3)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=60)
    assert [process.exitcode for process in processes] == [0, 0, 0]
    assert log.read_text().count("measured") == 1
