"""The run's trace as the driver writes it: opened at the first record, so a run that fails first changes nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tlt_cli.atomic_files import write_atomically
from tlt_cli.plugins import DriverPlugins
from tlt_cli.processes.run_directory import RECIPE_FILE
from tlt_cli.trace import STEP_RECORD, TraceWriter, truncate_trace


class RunTrace:
    """The run's trace, opened at its first record: until a step is recorded, nothing in it changes.

    On a resume the records of steps from `start_step` on are dropped then (they run again), the `run`
    record goes first, and a resume that changed settings writes the run's recipe.yaml (`recipe_text`) anew.
    """

    def __init__(
        self,
        path: Path,
        start_step: int,
        run_record: dict[str, Any],
        loggers: DriverPlugins,
        recipe_text: str | None = None,
    ):
        self.path, self.start_step, self.run_record = path, start_step, run_record
        self.recipe_text = recipe_text
        self.writer: TraceWriter | None = None
        # driver-side plugins see each step record once the trace holds it
        self.loggers = loggers

    @property
    def started(self) -> bool:
        return self.writer is not None

    def write(self, record: dict[str, Any]) -> None:
        if self.writer is None:
            if self.recipe_text is not None:
                write_atomically(self.path.parent / RECIPE_FILE, self.recipe_text)
            truncate_trace(self.path, self.start_step)
            self.writer = TraceWriter(self.path)
            self.writer.write(self.run_record)
        self.writer.write(record)
        if record["type"] == STEP_RECORD:
            self.loggers.step_recorded(record)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
