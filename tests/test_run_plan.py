"""The run's plan is made in one place: no recipe choice is resolved outside the composition root's setup.

The resolvers are the functions of tlt_cli/training/setup.py that turn a recipe's choices into the run's plan
(tlt_cli/tuning/run_plan.py): `planned_run` and its parts. Every call of one, read with `ast` from every tlt_cli
module, must come from a function in ALLOWED_CALLERS: setup itself, the recipe gate, and the commands and the
TRL script path that run without a driver. A worker (the native worker loop, TRL's process, the process
plumbing, a rollout backend's factory) calls none: it is handed the plan.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "tlt_cli"

RESOLVERS = frozenset(
    {
        "planned_run",
        "resolve_update_precision",
        "decode_plan",
        "decode_plan_for",
        "speculative_plan",
        "speculation_mode",
    }
)

# (module path under tlt_cli/, function or Class.method) -> why it may resolve a recipe choice
ALLOWED_CALLERS: dict[tuple[str, str], str] = {
    ("training/setup.py", "planned_run"): "the run's plan, made once by the driver",
    ("training/setup.py", "decode_plan"): "a part of the plan",
    ("training/setup.py", "_measured_decode_plan"): "decode_plan's measurement, over the model's shapes or weights",
    ("training/setup.py", "speculative_plan"): "a part of the plan",
    (
        "training/drafter_use.py",
        "drafter_needed",
    ): "whether the run speculates at all (the driver prepares the drafter)",
    ("recipe_checks.py", "checked_speculative_plan"): "the recipe gate checks the rule table before anything runs",
    ("profile/recording.py", "record_rollout"): "`tlt profile` decodes in its own process, without a driver",
    ("calibration/calibrate.py", "load_model_pair"): "`tlt calibrate` decodes in its own process, without a driver",
    ("bench/common.py", "run_decode_plan"): "`tlt bench` decodes in its own process, as the driver would plan it",
    ("bench/common.py", "auto_speculative_plan"): "`tlt bench rollout` builds mode auto's plan for its own decoding",
    ("bench/update_worker.py", "measure"): "`tlt bench update` plans its one rank as the driver plans a run",
    ("integrations/trl.py", "checked_rollout_sections"): "a user's TRL script has no driver: its sections are "
    "checked and planned as a recipe's (under tlt train the plan is given)",
    ("integrations/trl.py", "TltRollout._build"): "a user's TRL script has no driver (under tlt train it is given)",
}


def resolver_calls() -> set[tuple[str, str]]:
    """(module path, enclosing top-level function or Class.method) of every call of a resolver in tlt_cli/."""
    found = set()
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        module = path.relative_to(PACKAGE_ROOT).as_posix()
        for top in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(top, ast.ClassDef):
                units = [(f"{top.name}.{item.name}", item) for item in top.body if isinstance(item, ast.FunctionDef)]
            elif isinstance(top, ast.FunctionDef):
                units = [(top.name, top)]
            else:
                units = [("<module>", top)]
            for name, unit in units:
                for node in ast.walk(unit):
                    if isinstance(node, ast.Call) and called_name(node.func) in RESOLVERS:
                        found.add((module, name))
    return found


def called_name(function: ast.expr) -> str | None:
    if isinstance(function, ast.Attribute):
        return function.attr
    return function.id if isinstance(function, ast.Name) else None


def test_no_recipe_choice_is_resolved_outside_setup_and_the_driverless_commands():
    calls = resolver_calls()
    outside = sorted(calls - set(ALLOWED_CALLERS))
    assert not outside, f"a recipe choice resolved outside setup (hand it the run's plan instead): {outside}"
    # the worker side is handed the plan: none of its modules resolves anything
    worker_side = ("training/worker_loop.py", "integrations/trl_run.py", "processes/", "rollout/", "sglang/")
    assert not [call for call in calls if call[0].startswith(worker_side)]
    assert ("training/setup.py", "planned_run") in calls  # the scan sees setup's own calls


def test_every_allowed_caller_still_resolves_something():
    """An entry that no longer calls a resolver is stale: the allowance would hide a new caller of that name."""
    assert set(ALLOWED_CALLERS) <= resolver_calls()
