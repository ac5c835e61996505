"""The rollout's precision: float32 or bfloat16, chosen by measurement per machine and model, and cached.

Speculative decoding pays when verifying a block of drafted tokens costs about one decode step. On matrix
units (GPU tensor cores, CPUs with AMX) that holds in bfloat16 and not in float32 (a 16-token verify of
SmolLM2-135M on an AMX Xeon: 1.21x a 1-row step in bfloat16, 2.46x in float32); on other CPUs bfloat16
gains little, and a bfloat16 rollout samples from a slightly different policy than the float32 learner
(tlt_cli/training measures and corrects that). So the dtype is measured, not assumed; the composition root
(tlt_cli/training/setup.py `decode_plan_for`) is the one caller, and the rollout decodes in the dtype of the
plan it makes: the `PrecisionChoice` here gives it (`torch_dtype`), its run-log line (`describe()`) and the
trace's record (`to_record()`).

`float32` and `bfloat16` are taken as given. `auto` reads the choice cached for this machine and model, or
measures it first (about 2 s for SmolLM2-135M, milliseconds for the built-in tiny model): the owned decode
forward of `policy` (tlt_cli/engine/llama_family.py) in each dtype, float32 with the measured linear-form
plan a worker uses, times the passes a rollout makes (logits included, over a 64-token prefix, in interleaved
rounds; best CPU time counts, so load from other processes moves it little): a decode step of the rollout's
full batch (`RolloutWorkload.rows`, a worker's sequences of one step, at most MAX_MEASURED_ROWS), a 1-row
decode step and a 16-token verify pass (4 rows x 4 tokens).

The choice weighs a rollout as TLT sees it: HEAD_SHARE of its time decoding the full batch, the rest in the
tail, where it speculates (a verify pass per round) or, with SD off, decodes one row at a time. bfloat16 is
chosen when that rollout is predicted at least MARGIN faster in it (its samples differ slightly from the float32
learner's, so a small gain does not pay for that). On a CPU without AMX (an AMD EPYC with avx512_bf16,
SmolLM2-135M) bfloat16 loses at one row (0.94x) and wins at four (1.52x) and in a verify (1.83x): one figure
alone would choose wrong. A model outside the owned family decodes through transformers in its own dtype:
`auto` keeps it, and so it does for a learner that cannot correct the mismatch (`correctable=False`: a user's own
TRL GRPOTrainer, whose loss tlt's rollout cannot reach; docs/trl.md).

Cache: `<cache_dir>/rollout_precision/<hash>.json` holds the figures, keyed by the machine (tuning/cache.py),
the model's shapes, the linear-form plan and the measured row count, written atomically under a file lock so
concurrent ranks measure once; the choice is made from them for each workload.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from tlt_cli.config import RolloutDtype
from tlt_cli.engine import decode_model_for
from tlt_cli.engine.linear_forms import LinearFormPlan
from tlt_cli.engine.llama_family import refusal
from tlt_cli.rollout.decode_plan import DECODE_DTYPES
from tlt_cli.tuning.cache import cached_record, machine_key, positive_figures
from tlt_cli.tuning.timing import block_pass, milliseconds, random_prefix, repeats_for

CACHE_FOLDER = "rollout_precision"
MEASUREMENT_FORMAT = 2
# the figures a measurement records, each in milliseconds per dtype name
FIGURES = ("step_ms", "batch_step_ms", "verify_ms")
ROUNDS = 5
PREFIX_TOKENS = 64
VERIFY_ROWS, VERIFY_TOKENS = 4, 4
# the full-batch step is measured at most this wide (a wider batch is compute-bound already: the ratio holds)
MAX_MEASURED_ROWS = 16
# the share of a rollout's time spent decoding its full batch; the rest is the tail (TLT's long tail)
HEAD_SHARE = 0.5
# bfloat16 must make the rollout this much faster to be chosen: its samples differ from float32's
MARGIN = 0.1


@dataclass(frozen=True)
class RolloutWorkload:
    """The passes a rollout makes: `rows` sequences decoded together at its start (a worker's prompts of one step
    times the group size), and whether its tail speculates (verify passes) or decodes one row at a time."""

    rows: int = 1
    speculates: bool = False

    @property
    def measured_rows(self) -> int:
        return max(1, min(self.rows, MAX_MEASURED_ROWS))


@dataclass(frozen=True)
class PrecisionChoice:
    """The rollout's dtype and why: `given` (the recipe named it), `measured` (auto, figures below) or
    `model dtype: ...` (auto on a model the owned forward does not decode, or for a learner that cannot correct the
    mismatch). step_ms / batch_step_ms / verify_ms: per
    dtype name, the best 1-row decode step, `rows`-row decode step and 16-token verify, in milliseconds (empty
    unless measured); speculates: whether the tail was weighed as verify passes."""

    dtype: str
    reason: str
    step_ms: dict[str, float]
    verify_ms: dict[str, float]
    batch_step_ms: dict[str, float] = field(default_factory=dict)
    rows: int = 1
    speculates: bool = False

    @property
    def torch_dtype(self) -> torch.dtype:
        return DECODE_DTYPES[self.dtype]

    @property
    def workload(self) -> RolloutWorkload:
        return RolloutWorkload(self.rows, self.speculates)

    def describe(self) -> str:
        """One line for the run log: the dtype, the figures that chose it and the speed-up they predict."""
        if not _complete(self.step_ms, self.verify_ms):
            return f"rollout dtype: {self.dtype} ({self.reason})"
        rows = self.workload.measured_rows
        with_batch = _complete(self.batch_step_ms)
        figures = "; ".join(
            f"{name} step {self.step_ms[name]:.1f} ms, "
            + (f"{rows}-row step {self.batch_step_ms[name]:.1f} ms, " if with_batch else "")
            + f"16-token verify {self.verify_ms[name]:.1f} ms ({self.verify_ms[name] / self.step_ms[name]:.2f}x a step)"
            for name in DECODE_DTYPES
        )
        if not with_batch:  # a trace written before the batch step was measured
            return f"rollout dtype: {self.dtype} ({self.reason}: {figures})"
        predicted = bfloat16_speedup(self.step_ms, self.batch_step_ms, self.verify_ms, self.speculates)
        tail = "speculating" if self.speculates else "SD off"
        return (
            f"rollout dtype: {self.dtype} ({self.reason}: {figures}; "
            f"a {rows}-row rollout, {tail}, predicted {predicted:.2f}x faster in bfloat16)"
        )

    def to_record(self) -> dict:
        """What the trace's run record and `tlt profile` carry."""
        return asdict(self)


def rollout_precision(
    setting: RolloutDtype | str,
    policy: nn.Module,
    linear_plan: LinearFormPlan | None,
    cache_dir: Path,
    workload: RolloutWorkload = RolloutWorkload(),
    correctable: bool = True,
    follows_updates: bool = True,
) -> PrecisionChoice:
    """The dtype the rollout decodes `policy` in, for the recipe's `rollout.dtype` and the rollout's `workload`
    (see the module docstring). correctable: whether the learner corrects the rollout/learner mismatch; if not,
    `auto` keeps the policy's own dtype (a trainer of another library that cannot reach its loss); and so it does
    when bfloat16 copies would not follow the updates (`follows_updates=False`: rounded to nearest)."""
    setting = RolloutDtype.of(setting, "rollout.dtype")
    if setting != RolloutDtype.auto:
        return PrecisionChoice(setting.value, "given", {}, {})
    reason = refusal(policy)
    if reason is not None or not correctable or not follows_updates:
        own = str(policy.get_input_embeddings().weight.dtype).removeprefix("torch.")
        why = "model dtype: transformers path" if reason is not None else "model dtype: the trainer cannot correct"
        if reason is None and correctable:
            why = "model dtype: bfloat16 rounded to nearest does not follow small updates"
        return PrecisionChoice(own if own in DECODE_DTYPES else "float32", why, {}, {})
    rows = workload.measured_rows
    key = {
        "format": MEASUREMENT_FORMAT,
        **machine_key(_device_of(policy)),
        "model": model_key(policy, linear_plan),
        "rows": rows,
    }
    record, _ = cached_record(
        cache_dir, CACHE_FOLDER, key, lambda: _measured_record(policy, linear_plan, rows), valid_record
    )
    step_ms, batch_step_ms, verify_ms = record["step_ms"], record["batch_step_ms"], record["verify_ms"]
    dtype = choose_dtype(step_ms, batch_step_ms, verify_ms, workload.speculates)
    return PrecisionChoice(dtype, "measured", step_ms, verify_ms, batch_step_ms, workload.rows, workload.speculates)


def bfloat16_speedup(
    step_ms: dict[str, float], batch_step_ms: dict[str, float], verify_ms: dict[str, float], speculates: bool
) -> float:
    """How much faster a rollout is predicted in bfloat16: HEAD_SHARE of float32's time at the full batch, the rest
    in the tail (verify passes when it speculates, else 1-row steps), each part scaled by bfloat16's ratio."""
    tail_ms = verify_ms if speculates else step_ms
    bfloat16_time = HEAD_SHARE * batch_step_ms["bfloat16"] / batch_step_ms["float32"] + (1 - HEAD_SHARE) * (
        tail_ms["bfloat16"] / tail_ms["float32"]
    )
    return 1 / bfloat16_time


def choose_dtype(
    step_ms: dict[str, float], batch_step_ms: dict[str, float], verify_ms: dict[str, float], speculates: bool
) -> str:
    """bfloat16 when it makes the rollout (full batch, then the tail) at least MARGIN faster; else float32."""
    speedup = bfloat16_speedup(step_ms, batch_step_ms, verify_ms, speculates)
    return "bfloat16" if speedup >= 1 + MARGIN else "float32"


def measure_precision(
    policy: nn.Module, linear_plan: LinearFormPlan | None, rows: int, rounds: int = ROUNDS
) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """(1-row step ms, `rows`-row step ms, 16-token verify ms) per dtype name: the owned forward's best of `rounds`
    interleaved rounds (one row wide, the batch step is the 1-row step, timed once)."""
    passes = {name: _timed_passes(policy, dtype, linear_plan, rows) for name, dtype in DECODE_DTYPES.items()}
    best: dict[str, dict[str, float]] = {}
    with torch.no_grad():
        device = _device_of(policy)
        repeats = {
            name: {kind: repeats_for(run, device) for kind, run in runs.items()} for name, runs in passes.items()
        }
        for _ in range(rounds):
            for name, runs in passes.items():
                for kind, run in runs.items():
                    figures = best.setdefault(kind, {})
                    figures[name] = min(figures.get(name, float("inf")), milliseconds(run, repeats[name][kind], device))
    return best["step_ms"], best.get("batch_step_ms", dict(best["step_ms"])), best["verify_ms"]


def valid_record(record: dict) -> bool:
    """Whether a stored record holds a finite positive time per dtype for each figure (tlt_cli/tuning/cache.py)."""
    return all(positive_figures(record.get(figure), DECODE_DTYPES) for figure in FIGURES)


def _measured_record(policy: nn.Module, linear_plan: LinearFormPlan | None, rows: int) -> dict:
    figures = zip(FIGURES, measure_precision(policy, linear_plan, rows))
    return {name: {key: round(value, 3) for key, value in values.items()} for name, values in figures}


def _timed_passes(
    policy: nn.Module, dtype: torch.dtype, linear_plan: LinearFormPlan | None, rows: int
) -> dict[str, Callable[[], None]]:
    """A 1-row decode step, a `rows`-row decode step (when rows > 1) and a VERIFY_ROWS x VERIFY_TOKENS verify, by
    the name of their figures, each with its logits, over a prefilled prefix of PREFIX_TOKENS (timing.py)."""
    model = decode_model_for(policy, dtype=dtype, linear_plan=linear_plan)
    prefix = random_prefix(policy, max(VERIFY_ROWS, rows), PREFIX_TOKENS)
    passes = {
        "step_ms": block_pass(model, prefix, 1, 1),
        "verify_ms": block_pass(model, prefix, VERIFY_ROWS, VERIFY_TOKENS),
    }
    return passes | ({"batch_step_ms": block_pass(model, prefix, rows, 1)} if rows > 1 else {})


def model_key(policy: nn.Module, linear_plan: LinearFormPlan | None) -> dict:
    """What the measurement depends on besides the machine: every weight's shape and dtype, and the plan."""
    shapes: dict[str, int] = {}
    for parameter in policy.parameters():
        name = f"{'x'.join(map(str, parameter.shape))} {str(parameter.dtype).removeprefix('torch.')}"
        shapes[name] = shapes.get(name, 0) + 1
    return {
        "model_type": policy.config.model_type,
        "shapes": dict(sorted(shapes.items())),
        "linear_plan": linear_plan.to_dict() if linear_plan is not None else None,
    }


def _complete(*figures: dict[str, float]) -> bool:
    """Whether each of `figures` has a positive time for every dtype (a trace may carry partial or zero ones)."""
    return all(set(values) == set(DECODE_DTYPES) and all(value > 0 for value in values.values()) for values in figures)


def _device_of(policy: nn.Module) -> torch.device:
    return next(policy.parameters()).device
