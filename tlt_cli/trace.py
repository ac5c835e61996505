"""The run's JSONL event log: one JSON object per line, each with a "type".

Record types written by the driver of `tlt train` (tlt_cli/processes/driver.py and
step_records.py; fields in docs/running.md, "The run directory"):
  run        once per start or resume: recipe name, world size, steps, resumed_from_step
  request    one per generated response: step, worker, request_id, start, end, prompt_tokens,
             tokens, reward, finished_by_eos, and speculative-decoding counters
  worker     one per worker per step: busy_start, busy_end, idle_start, idle_end, idle_seconds,
             memory_rollout_peak_gb and memory_update_peak_gb (its resident peaks, GB, in the rollout
             and in the reward, update and weight sync), memory_peak_gb (the highest of any worker
             in the step), and the numbers plugins added, each under its plugin's prefix (drafter_*, ...)
  sd_config  one per worker per step per SD configuration it decoded in ("off" = plain):
             config, and the decode steps, tokens and seconds spent in it, and per draft
             source (drafter, ngram) its verify passes and accepted tokens, and the collapses and
             recoveries of a draft source or bucket at its steps (the console shows only each one's first)
             and mode auto's drops of it where the run measured it slower than plain (plain_drops)
  warning    one per warning shown under the live table (SD collapse, a plugin disabled, an
             SGLang sync): step, worker, message, and details (a failing plugin's traceback)
  step       one per step: timings (rollout, reward, update, step) and metrics, with
             memory_peak_gb: the highest worker's resident peak in the step
`tlt profile` of a recipe writes run, request, worker and step records the same way. Only one
process writes a trace. A write the disk refuses (full, read-only) is a `TraceWriteError`, one
sentence naming the trace. `read_trace` is the strict reader used by tools: a line that is not a
JSON object is an error naming the line. `numbered_records` is the one JSONL reader beneath it and
beneath `tlt profile`'s (tlt_cli/profile/records.py), which passes its own error type.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

from tlt_cli.atomic_files import write_atomically
from tlt_cli.errors import UserError, writing

LOGGER = logging.getLogger(__name__)

# the record that ends a step: the trace is fsynced after it
STEP_RECORD = "step"
# what to do about it; the driver adds whether a checkpoint can be resumed (it knows the run directory)
WRITE_ADVICE = "free some space."
# the most digits of a 64-bit integer (2^63 has 19)
INTEGER_DIGITS = 19


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file and line."""


class TraceWriteError(UserError):
    """A trace the disk refuses to extend (full, read-only); the message names the file."""


class TraceWriter:
    """Appends records to a trace file, one flushed line each, so a killed run loses at most one line.

    Each step record (the last of its step) is also fsynced, so a power cut loses at most the step
    being run. Cost: one fsync per step, 5 ms on the 2-core test machine against steps of seconds
    (an fsync per record would be one per generated response, hundreds per step).
    """

    def __init__(self, path: Path):
        self.path = path
        with writing(path, WRITE_ADVICE, TraceWriteError):
            self._file: TextIO = path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        with writing(self.path, WRITE_ADVICE, TraceWriteError):
            self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
            self._file.flush()
            if record.get("type") == STEP_RECORD:
                os.fsync(self._file.fileno())

    def close(self) -> None:
        # a line a full disk refused stays in the buffer: it was reported when written, closing drops it
        with contextlib.suppress(OSError):
            self._file.close()


def request_record(
    *,
    step: int,
    worker: int,
    request_id: int,
    start: float,
    end: float,
    prompt_tokens: int,
    tokens: int,
    reward: float,
    finished_by_eos: bool,
    verify_passes: int = 0,
    accepted_tokens: int = 0,
    accepted_by_depth: Sequence[int] = (),
    proposed_by_depth: Sequence[int] = (),
) -> dict[str, Any]:
    """A `request` record: one generated response (tlt's worker loop and the TRL worker both write them).

    start / end: time.time() seconds; tokens: the response's; accepted_tokens: draft tokens accepted
    over its verify_passes (0 and 0 without SD); accepted_by_depth[d] / proposed_by_depth[d]: its
    verify passes whose depth-d draft was accepted / drafted (empty where not counted).
    """
    return {
        "type": "request",
        "step": step,
        "worker": worker,
        "request_id": request_id,
        "start": start,
        "end": end,
        "prompt_tokens": prompt_tokens,
        "tokens": tokens,
        "reward": reward,
        "finished_by_eos": finished_by_eos,
        "verify_passes": verify_passes,
        "accepted_tokens": accepted_tokens,
        "accepted_by_depth": list(accepted_by_depth),
        "proposed_by_depth": list(proposed_by_depth),
    }


def read_trace(path: Path) -> list[dict[str, Any]]:
    """All records of a trace; TraceError names the first bad line."""
    if not path.is_file():
        raise TraceError(f"trace file {path} does not exist.")
    records = []
    for number, record in numbered_records(path):
        if "type" not in record:
            raise TraceError(f"{path} line {number} is not a trace record (a JSON object with a 'type').")
        records.append(record)
    return records


def numbered_records(path: Path, error: type[Exception] = TraceError) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) of every non-blank line of a JSONL file (a trace, or `tlt profile`'s
    per-request records); a line that is not a JSON object raises `error` naming it."""
    lines = utf8_text(path, error).split("\n")
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line, parse_int=_record_integer)
        except json.JSONDecodeError as decode_error:
            if number == len(lines):
                raise error(
                    f"{path} line {number} (the last) is cut short ({decode_error.msg}): the file is truncated; "
                    "wait for the run to write it, or delete that line."
                ) from None
            raise error(
                f"{path} line {number} is not valid JSON ({decode_error.msg}); fix or delete that line."
            ) from None
        except (ValueError, RecursionError) as damage:  # _record_integer's refusal, or nesting past Python's stack
            reason = str(damage) if isinstance(damage, ValueError) else "it nests deeper than Python reads"
            raise error(f"{path} line {number} is not a record ({reason}); fix or delete that line.") from None
        if not isinstance(record, dict):
            raise error(f"{path} line {number} is not a JSON object; each line must be one record.")
        yield number, record


def _record_integer(text: str) -> int:
    """A JSON integer of a record: steps, counts, token ids and byte sizes, all within 64 bits; a longer one is
    damage (and Python refuses to convert one of more than 4,300 digits at all)."""
    digits = text.lstrip("-")
    if len(digits) > INTEGER_DIGITS or not -(2**63) <= int(text) < 2**63:
        raise ValueError(f"the number {text[:INTEGER_DIGITS]}... does not fit in 64 bits")
    return int(text)


def utf8_text(path: Path, error: type[Exception] = TraceError) -> str:
    """The file's text; a byte that is not UTF-8 raises `error` naming its line."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as decode_error:
        line = data.count(b"\n", 0, decode_error.start) + 1
        raise error(
            f"{path} line {line} is not UTF-8 text (byte 0x{data[decode_error.start]:02x}); save the file as UTF-8."
        ) from None


def truncate_trace(path: Path, first_dropped_step: int) -> None:
    """Drop records of steps >= first_dropped_step (they will be run again), atomically.

    A last line cut short by a kill is dropped too; every complete earlier record is kept.
    """
    if not path.is_file():
        return
    kept, damaged = [], []
    with path.open("rb") as lines:
        for number, line in enumerate(lines, start=1):
            record = lenient_record(line)
            if record is None:
                if line.endswith(b"\n") and line.strip():  # a last line cut short by a kill is no damage
                    damaged.append(number)
                continue
            step = record.get("step", -1)
            if step < first_dropped_step:
                text = line.decode("utf-8")
                kept.append(text if text.endswith("\n") else text + "\n")
    if damaged:
        LOGGER.warning(
            "trace %s: line%s %s %s damaged (not a trace record) and %s dropped.",
            path,
            "s" if len(damaged) > 1 else "",
            ", ".join(map(str, damaged[:5])) + (", ..." if len(damaged) > 5 else ""),
            "are" if len(damaged) > 1 else "is",
            "are" if len(damaged) > 1 else "is",
        )
    with writing(path, WRITE_ADVICE, TraceWriteError):
        write_atomically(path, "".join(kept))


def lenient_record(line: bytes | str) -> dict[str, Any] | None:
    """The trace record on one line, or None when the line is not one (not UTF-8, not JSON, an integer past 64
    bits, nesting past Python's stack, not an object, no string 'type', a 'step' that is not a 64-bit count):
    what a resume reads the trace with, dropping damage instead of failing on it."""
    try:
        record = json.loads(line, parse_int=_record_integer)
    except Exception:  # noqa: BLE001 - any damage of a line makes it no record
        return None
    if not isinstance(record, dict) or not isinstance(record.get("type"), str):
        return None
    step = record.get("step", 0)
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return None
    return record
