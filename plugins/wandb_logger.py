"""The Weights & Biases logger: each step record of a run logged to W&B, the recipe as the run's config.

Enable it with `plugins.enabled: [..., wandb]` (the `wandb` extra installs the package:
`pip install 'tlt[wandb]'`). It runs in the driver only (driver-side hooks, tlt_cli/plugins.py):
at run start it opens a W&B run named after the tlt run, with the resolved recipe as its config
and its files under <run directory>/wandb; per step it logs every number of the step record as
the trace holds it (reward, response lengths, phase seconds, idle worker-seconds, accept
length, plugin metrics such as drafter_loss) at the step's number.

It runs offline (nothing leaves the machine; `wandb sync <run directory>/wandb/offline-run-*`
uploads later) unless the user set W&B up: WANDB_MODE or WANDB_API_KEY in the environment, or
the `mode` option (plugins.options.wandb: {mode: online, project: my-project, entity: my-team}).
Under train.trainer trl, TRL's own W&B logging (report_to: wandb) logs TRL's numbers as a second
W&B run (<run name>-trl, files under <run directory>/trl/wandb), in the same mode. Without the
package, or if W&B fails, the run shows one warning and goes on without it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tlt_cli.plugins import RunInfo, scalar_metrics

PROJECT = "tlt"
# TRL's own W&B run's folder under the run directory (train.trainer trl)
TRL_FOLDER = "trl"
# seconds to wait for W&B's service process to start (it is slow to start on a loaded machine)
INIT_TIMEOUT_SECONDS = 300.0


class WandbLogger:
    """Logs the run's step records to a W&B run (see the module docstring)."""

    def __init__(self, recipe: Any, project: str = PROJECT, entity: str | None = None, mode: str | None = None):
        self.project, self.entity, self.mode = project, entity, mode
        self.run: Any = None

    # under TRL, TRL's own W&B callback logs TRL's numbers too (tlt_cli/plugins.py trl_reporting)
    trl_report_to = "wandb"

    @staticmethod
    def trl_environment(
        run_directory: Path, project: str = PROJECT, entity: str | None = None, mode: str | None = None
    ) -> dict[str, str]:
        """What TRL's W&B callback reads: its folder, project, run name, entity and mode (offline by default)."""
        environment = {
            "WANDB_DIR": str(run_directory / TRL_FOLDER),
            "WANDB_PROJECT": project,
            "WANDB_NAME": f"{run_directory.name}-trl",
            # its notes would land on the driver's terminal under the live table; the worker log has TRL's
            "WANDB_SILENT": "true",
        }
        if entity is not None:
            environment["WANDB_ENTITY"] = entity
        chosen = _chosen_mode(mode)
        if chosen is not None:
            environment["WANDB_MODE"] = chosen
        return environment

    def on_run_start(self, run: RunInfo) -> None:
        try:
            import wandb
        except ImportError:
            raise ImportError(
                "the wandb package is not installed; pip install 'tlt[wandb]' to log to Weights & Biases"
            ) from None
        self.run = wandb.init(
            project=self.project,
            entity=self.entity,
            name=run.name,
            dir=str(run.run_directory),
            config=run.recipe,
            mode=_chosen_mode(self.mode),
            settings=wandb.Settings(console="off", silent=True, init_timeout=INIT_TIMEOUT_SECONDS),
        )

    def on_step_record(self, record: dict[str, Any]) -> None:
        self.run.log(scalar_metrics(record), step=record["step"])

    def on_run_end(self) -> None:
        if self.run is not None:
            self.run.finish()


def _chosen_mode(mode: str | None) -> str | None:
    """The option's mode, else None where the user set W&B up in the environment (W&B decides), else offline."""
    if mode is not None:
        return mode
    if os.environ.get("WANDB_MODE") or os.environ.get("WANDB_API_KEY"):
        return None
    return "offline"
