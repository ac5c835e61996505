"""The run's fidelity guard: one warning when the rollout stops sampling the policy being trained.

A fast rollout counts only while its samples are the policy's. The driver hands every step record to
`FidelityGuard.check`, which compares two figures with the first step's (step 0's, or the first recorded
step before a resume): the rollout/learner K3 KL (`actor_rollout_kl_k3`, the rollout's own log-probs
against the learner's) and, with bfloat16 compute on CPU, the learner's K3 KL from its float32 master
weights (`actor_precision_kl_k3`). A figure at least JUMP (5) times its first value, and above FLOOR (a float32
run's 1e-12 noise is no signal), gives one sentence naming the figure, both values, the likely cause and
the setting that avoids it, once per figure per run; the driver shows it under the live table and keeps it
in the trace as a warning record (`kind: fidelity`), which `tlt profile` lists. A first step cannot be its own
baseline when it is already wrong: where the rounding of the run's dtypes bounds the rollout/learner KL
(`rounding_ceiling`: a float32 rollout and learner on CPU measure 1e-14 to 1e-10), a KL above that bound warns
at any step, step 0 included.

Example:
    rollout_dtype = decode_plan.dtype
    guard = FidelityGuard(
        fidelity_advice(recipe, rollout_dtype), earlier_step_records, rounding_ceiling(recipe, rollout_dtype)
    )
    for message in guard.check(step_record):
        warn(message)
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from tlt_cli.config import CPU_DEVICES, Bfloat16Rounding, Precision, Recipe, RolloutDtype

# a step's KL this many times its first step's is a jump: round-to-nearest bfloat16 copies measured 8x on a small
# real-cpu run and 10-50x on a whole one, stochastically rounded copies 1.6-2.1x (BENCHMARKS.md, issue 47)
JUMP = 5.0
# below this a KL is rounding noise whatever its ratio (bfloat16 rollouts measure 7e-4 at step 0)
FLOOR = 1e-3
ROLLOUT_KL = "actor_rollout_kl_k3"
WATCHED = {
    ROLLOUT_KL: "the rollout/learner KL",
    "actor_precision_kl_k3": "the bfloat16 learner's KL from its float32 weights",
}
# a float32 rollout against a float32 learner on CPU measures a KL of 1e-14 to 1e-10 (rounding alone): one above
# this is no rounding (a packed update ignoring a sliding window measured 3.5e-3, issue 65)
FLOAT32_CEILING = 1e-6


def rounding_ceiling(recipe: Recipe, rollout_dtype: str) -> float | None:
    """The largest rollout/learner KL the rounding of this run's dtypes explains (its precision resolved, the
    rollout in `rollout_dtype`): FLOAT32_CEILING for float32 on both sides on CPU; None where bfloat16 or a
    GPU's kernels make the noise too large for a fixed bound (the jump from the first step still counts)."""
    float32 = rollout_dtype == RolloutDtype.float32.value and recipe.actor.precision == Precision.fp32
    return FLOAT32_CEILING if float32 and recipe.actor.devices == CPU_DEVICES else None


def fidelity_advice(recipe: Recipe, rollout_dtype: str) -> str:
    """The likely cause of a jump under this recipe (its precision resolved) and a rollout in `rollout_dtype`
    (the decode plan's), and the setting that avoids it."""
    bfloat16 = rollout_dtype == RolloutDtype.bfloat16.value or recipe.actor.precision == Precision.bf16
    if bfloat16 and recipe.actor.bfloat16_rounding == Bfloat16Rounding.nearest:
        return (
            "likely cause: bfloat16 copies rounded to nearest, which a small update moves far more than the policy; "
            "set actor.bfloat16_rounding=stochastic"
        )
    if bfloat16:
        return (
            "likely cause: bfloat16 where this update moves the weights less than its rounding can follow; "
            "rollout.dtype=float32 actor.precision=fp32 avoids it"
        )
    return (
        "likely cause: a rollout that decodes other weights than the learner's (a weight sync that did not land) "
        "or a learner that computes another model (attention the update does not reproduce)"
    )


class FidelityGuard:
    """See the module docstring. earlier: step records of this run before a resume (the first one's figures
    stay the baseline)."""

    def __init__(self, advice: str, earlier: Iterable[dict[str, Any]] = (), ceiling: float | None = None) -> None:
        """earlier: the trace's step records before a resume (their first figures are the baselines) and its
        fidelity warnings (`figure`: a figure already warned about is not warned about again: once per run);
        ceiling: the rollout/learner KL the run's rounding explains (`rounding_ceiling`), None: no fixed bound."""
        self.advice = advice
        self.ceiling = ceiling
        self.baselines: dict[str, float] = {}
        self.warned: set[str] = set()
        for record in sorted(earlier, key=lambda record: record.get("step", 0)):
            if record.get("type") == "warning" and record.get("kind") == "fidelity":
                self.warned.add(record.get("figure"))
            else:
                self._note_baselines(record)

    def check(self, record: dict[str, Any]) -> list[str]:
        """The messages this step record calls for (none, or one per figure that jumped for the first time)."""
        return list(self.check_figures(record).values())

    def check_figures(self, record: dict[str, Any]) -> dict[str, str]:
        """Figure -> message for each figure of this step record that jumped, or rose above what rounding explains,
        for the first time (a KL that is no longer a number, nan or infinite, is a jump)."""
        self._note_baselines(record)
        messages = {}
        for key, description in WATCHED.items():
            value = _figure(record, key, broken=True)
            if value is None or key in self.warned:
                continue
            finding = self._jump(key, value) or self._above_rounding(key, value)
            if finding is not None:
                self.warned.add(key)
                messages[key] = f"step {record.get('step')}: {description} is {value:.1e}, {finding} ({self.advice})."
        return messages

    def _jump(self, key: str, value: float) -> str | None:
        """How the figure jumped from its first step's, or None."""
        baseline = self.baselines.get(key)
        if baseline is None or (math.isfinite(value) and (value < FLOOR or value < JUMP * baseline)):
            return None
        ratio = f"{value / baseline:.0f}x" if baseline > 0 and math.isfinite(value) else "up from"
        return f"{ratio} the first step's {baseline:.1e}: the rollout no longer samples the policy being trained"

    def _above_rounding(self, key: str, value: float) -> str | None:
        """How the rollout/learner KL exceeds what the run's rounding explains, or None."""
        if key != ROLLOUT_KL or self.ceiling is None or value <= self.ceiling:
            return None
        return (
            f"above the {self.ceiling:.0e} that float32 rounding explains: the rollout does not sample the policy "
            "being trained"
        )

    def _note_baselines(self, record: dict[str, Any]) -> None:
        for key in WATCHED:
            value = _figure(record, key)
            if value is not None and key not in self.baselines:
                self.baselines[key] = value


def _figure(record: dict[str, Any], key: str, broken: bool = False) -> float | None:
    """The record's figure as a float; None when absent or not a KL (negative, not a number); nan and infinity
    only when `broken` (a check's, not a baseline's)."""
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if not math.isfinite(value):
        return float(value) if broken and value != -math.inf else None
    return float(value) if value >= 0 else None
