"""A checkpoint's SD schedule state restored only when it is whole and this schedule's, else the schedule starts fresh.

The adaptive schedules (the rule table's, tlt_cli/speculative/rule_schedule.py, and mode auto's cost model,
tlt_cli/speculative/cost_schedule.py) learn acceptance and timing corrections online; a checkpoint keeps what they
learned. What they learned is a heuristic's memory, never the policy's: a state that cannot be restored costs a few
exploratory decode steps, so it is never a reason to stop a resume. `restored_schedule(schedule, saved, path)`
restores `saved` into `schedule` when it has this schedule's fields (a checkpoint written under another
`speculative.mode` has another schedule's, or none), loads into a copy without raising, holds no NaN or negative
figure, and lets the copy choose a configuration; otherwise `schedule` is left fresh and the one sentence returned
names the file and why:

    warning = restored_schedule(schedule, load_checkpoint_file(path), path)   # None: restored
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

# the state's field that is Python's random state (validated by random.setstate, and holding a signed float)
RANDOM_FIELD = "random"


def restored_schedule(schedule: Any, saved: object, path: Path) -> str | None:
    """Restore `saved` into `schedule` (see the module docstring); None when restored, else the warning."""
    fresh = schedule.state_dict()
    if not isinstance(saved, dict) or set(saved) != set(fresh):
        return (
            f"SD schedule state {path} is not this schedule's (the checkpoint was written under another "
            "speculative.mode, or the file is damaged); the SD schedule starts fresh."
        )
    trial = copy.deepcopy(schedule)
    try:
        trial.load_state_dict(saved)
        problem = _figure_problem({key: value for key, value in trial.state_dict().items() if key != RANDOM_FIELD})
        if problem is not None:
            raise ValueError(problem)
        trial(1)  # a restored schedule can choose a configuration
    except Exception as error:  # noqa: BLE001 - any failure on a tampered state is damage, never a traceback
        reason = str(error).splitlines()[0][:120] if str(error) else type(error).__name__
        return f"SD schedule state {path} is damaged ({reason}); the SD schedule starts fresh."
    schedule.load_state_dict(saved)
    return None


def missing_schedule_state(path: Path) -> str:
    """The warning of a checkpoint without schedule state (SD was off, or fixed, when it was written)."""
    return (
        f"checkpoint {path.parent} holds no SD schedule state ({path.name}: speculative.mode did not adapt when it "
        "was written); the SD schedule starts fresh."
    )


def _figure_problem(value: object) -> str | None:
    """A figure of a schedule's state that is NaN or negative (an accept length may be infinite: not measured)."""
    if isinstance(value, dict):
        values = list(value.values())
    elif isinstance(value, (list, tuple, set, frozenset)):
        values = list(value)
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    elif math.isnan(value) or value < 0:
        return f"a figure of {value}"
    else:
        return None
    for inner in values:
        problem = _figure_problem(inner)
        if problem is not None:
            return problem
    return None
