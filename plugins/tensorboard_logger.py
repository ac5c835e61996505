"""The TensorBoard logger: each step record of a run as TensorBoard scalars, the recipe as text.

Enable it with `plugins.enabled: [..., tensorboard]` (the `tensorboard` extra installs the
package: `pip install 'tlt[tensorboard]'`). It runs in the driver only (driver-side hooks,
tlt_cli/plugins.py): at run start it opens an event file under <run directory>/tensorboard (the
`log_dir` option changes the folder's name) and writes the resolved recipe as a text summary
(TensorBoard's Text tab); per step it writes every number of the step record as the
trace holds it (reward, response lengths, phase seconds, idle worker-seconds, accept length,
plugin metrics such as drafter_loss), one scalar per record key at the step's number. So
`tensorboard --logdir runs` shows every run under runs/. Under train.trainer trl, TRL's own
TensorBoard logging (report_to: tensorboard) writes TRL's numbers beside them, in
<run directory>/tensorboard/trl. Without the package, or if a write fails, the run shows one
warning and goes on without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tlt_cli.plugins import RunInfo, scalar_metrics

FOLDER = "tensorboard"
# the subfolder TRL's own TensorBoard callback writes to under train.trainer trl
TRL_FOLDER = "trl"


class TensorBoardLogger:
    """Writes the run's step records to a TensorBoard event file (see the module docstring)."""

    # under TRL, TRL's own TensorBoard callback logs TRL's numbers too (tlt_cli/plugins.py trl_reporting)
    trl_report_to = "tensorboard"

    @staticmethod
    def trl_environment(run_directory: Path, log_dir: str = FOLDER, flush_secs: int = 30) -> dict[str, str]:
        """Where TRL's TensorBoard callback writes (transformers reads TENSORBOARD_LOGGING_DIR)."""
        return {"TENSORBOARD_LOGGING_DIR": str(run_directory / log_dir / TRL_FOLDER)}

    def __init__(self, recipe: Any, log_dir: str = FOLDER, flush_secs: int = 30):
        self.folder_name, self.flush_secs = log_dir, flush_secs
        self.writer: Any = None

    def on_run_start(self, run: RunInfo) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ImportError(
                "the tensorboard package is not installed; pip install 'tlt[tensorboard]' to log to TensorBoard"
            ) from None
        self.writer = SummaryWriter(log_dir=str(run.run_directory / self.folder_name), flush_secs=self.flush_secs)
        self.writer.add_text("recipe", _as_code_block(run), global_step=run.start_step)

    def on_step_record(self, record: dict[str, Any]) -> None:
        for key, value in scalar_metrics(record).items():
            self.writer.add_scalar(key, value, global_step=record["step"])
        self.writer.flush()

    def on_run_end(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _as_code_block(run: RunInfo) -> str:
    """The resolved recipe as YAML in a markdown code block (TensorBoard renders text as markdown)."""
    text = yaml.safe_dump(run.recipe, sort_keys=False)
    return "\n".join("    " + line for line in text.splitlines())
