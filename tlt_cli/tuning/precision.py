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
rounds until each figure's median is stable: tuning/timing.py `stable_medians`; CPU time counts, so load from
other processes moves it little): a plain decode step at each running batch size of `plain_rungs(rows)` (the
rollout's full batch, `RolloutWorkload.rows`, at most MAX_MEASURED_ROWS, and each power of two below it down to
one row: the batch sizes its long tail decodes at) and a 16-token verify pass (4 rows x 4 tokens). The plan's
pass-cost grid (tuning/pass_costs.py) takes the figures it shares with these (`shared_pass_ms`) instead of timing
those passes again, so the plan holds one figure for each pass.

The choice weighs a rollout as TLT sees it. With SD off, it decodes plain at every running batch size from its full
batch down to one row: response lengths spread about exponentially, so the batch halves in about as many decode
steps each time, and every rung of `plain_rungs` is weighed as the same number of steps. Speculating, HEAD_SHARE of
its time decodes the full batch and the rest is the tail, a verify pass per round. bfloat16 is chosen when that
rollout is predicted at least MARGIN faster in it (its samples differ slightly from the float32 learner's, so a
small gain does not pay for that). On a CPU without AMX (an AMD EPYC with avx512_bf16, SmolLM2-135M) bfloat16
loses at one row (0.94x) and wins at four (1.52x) and in a verify (1.83x): one figure alone would choose wrong. A
model outside the owned family decodes through transformers in its own dtype: `auto` keeps it, and so it does for
a learner that cannot correct the mismatch (`correctable=False`: a user's own TRL GRPOTrainer, whose loss tlt's
rollout cannot reach; docs/trl.md).

Cache: `<cache_dir>/rollout_precision/<hash>.json` holds the figures, keyed by the machine (tuning/cache.py),
the model's shapes, the linear-form plan and the measured row count, written atomically under a file lock so
concurrent ranks measure once; the choice is made from them for each workload.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from tlt_cli.config import RolloutDtype
from tlt_cli.engine import decode_model_for
from tlt_cli.engine.linear_forms import LinearFormPlan
from tlt_cli.engine.llama_family import refusal
from tlt_cli.rollout.decode_plan import DECODE_DTYPES
from tlt_cli.tuning.cache import cached_record, machine_key, positive_figures
from tlt_cli.tuning.timing import block_passes, pass_timer, random_prefix, stable_medians

CACHE_FOLDER = "rollout_precision"
MEASUREMENT_FORMAT = 3
# the figures a measurement records, each in milliseconds per dtype name (tail_step_ms: per rung, then dtype)
FIGURES = ("step_ms", "batch_step_ms", "verify_ms")
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


def plain_rungs(rows: int) -> tuple[int, ...]:
    """The running batch sizes a plain rollout of `rows` rows (measured_rows) is weighed at, ascending: every power of
    two below `rows`, and `rows` (module docstring)."""
    rungs = [1 << exponent for exponent in range(max(1, rows).bit_length()) if 1 << exponent < rows]
    return (*rungs, max(1, rows))


@dataclass(frozen=True)
class PrecisionChoice:
    """The rollout's dtype and why: `given` (the recipe named it), `measured` (auto, figures below) or
    `model dtype: ...` (auto on a model the owned forward does not decode, or for a learner that cannot correct the
    mismatch). step_ms / batch_step_ms / verify_ms: per
    dtype name, the stable median 1-row decode step, `rows`-row decode step and 16-token verify, in milliseconds
    (empty unless measured); tail_step_ms: per running batch size between those two (`plain_rungs`, as text), the
    decode step per dtype name; speculates: whether the tail was weighed as verify passes."""

    dtype: str
    reason: str
    step_ms: dict[str, float]
    verify_ms: dict[str, float]
    batch_step_ms: dict[str, float] = field(default_factory=dict)
    rows: int = 1
    speculates: bool = False
    tail_step_ms: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DECODE_DTYPES[self.dtype]

    @property
    def workload(self) -> RolloutWorkload:
        return RolloutWorkload(self.rows, self.speculates)

    def plain_step_ms(self) -> dict[int, dict[str, float]]:
        """Per running batch size of `plain_rungs`, the plain decode step in milliseconds per dtype name."""
        rungs = plain_rungs(self.workload.measured_rows)
        between = {int(rows): figures for rows, figures in self.tail_step_ms.items()}
        return {1: self.step_ms, **between, rungs[-1]: self.batch_step_ms}

    def shared_pass_ms(self) -> dict[tuple[int, int], float]:
        """(rows, tokens per row) -> milliseconds of the passes measured here in the chosen dtype: what the pass-cost
        grid takes instead of timing them again (empty unless measured)."""
        if not _complete(self.step_ms, self.batch_step_ms, self.verify_ms):
            return {}
        passes = {(rows, 1): figures[self.dtype] for rows, figures in self.plain_step_ms().items()}
        return passes | {(VERIFY_ROWS, VERIFY_TOKENS): self.verify_ms[self.dtype]}

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
        predicted = bfloat16_speedup(self.plain_step_ms(), self.verify_ms, self.speculates)
        tail = "speculating" if self.speculates else f"SD off, steps at {', '.join(map(str, plain_rungs(rows)))} rows"
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
    measured = PrecisionChoice(
        "float32",
        "measured",
        record["step_ms"],
        record["verify_ms"],
        record["batch_step_ms"],
        workload.rows,
        workload.speculates,
        record["tail_step_ms"],
    )
    return replace(measured, dtype=choose_dtype(measured.plain_step_ms(), measured.verify_ms, workload.speculates))


def bfloat16_speedup(
    plain_step_ms: dict[int, dict[str, float]], verify_ms: dict[str, float], speculates: bool
) -> float:
    """How much faster a rollout is predicted in bfloat16, from its plain steps per running batch size (rows ->
    dtype -> ms, `plain_rungs`) and its verify pass: speculating, HEAD_SHARE of float32's time at the full batch
    and the rest in verify passes, each part scaled by bfloat16's ratio; with SD off, the same number of decode
    steps at every batch size (module docstring)."""
    if not speculates:
        return sum(step["float32"] for step in plain_step_ms.values()) / sum(
            step["bfloat16"] for step in plain_step_ms.values()
        )
    full_batch = plain_step_ms[max(plain_step_ms)]
    bfloat16_time = HEAD_SHARE * full_batch["bfloat16"] / full_batch["float32"] + (1 - HEAD_SHARE) * (
        verify_ms["bfloat16"] / verify_ms["float32"]
    )
    return 1 / bfloat16_time


def choose_dtype(plain_step_ms: dict[int, dict[str, float]], verify_ms: dict[str, float], speculates: bool) -> str:
    """bfloat16 when it makes the rollout (bfloat16_speedup) at least MARGIN faster; else float32."""
    speedup = bfloat16_speedup(plain_step_ms, verify_ms, speculates)
    return "bfloat16" if speedup >= 1 + MARGIN else "float32"


def measure_precision(
    policy: nn.Module, linear_plan: LinearFormPlan | None, rows: int
) -> tuple[dict[int, dict[str, float]], dict[str, float]]:
    """(plain step ms per running batch size of `plain_rungs(rows)`, 16-token verify ms), each per dtype name: the
    owned forward's stable medians over interleaved rounds (tuning/timing.py `stable_medians`)."""
    device = _device_of(policy)
    timers = {
        (name, kind): pass_timer(run, device)
        for name, dtype in DECODE_DTYPES.items()
        for kind, run in _timed_passes(policy, dtype, linear_plan, rows).items()
    }
    with torch.no_grad():  # a pass's two dtypes are compared: timed in the same rounds
        medians, _ = stable_medians(timers, compared=lambda key: key[1])
    plain = {rung: {name: medians[name, rung] for name in DECODE_DTYPES} for rung in plain_rungs(rows)}
    return plain, {name: medians[name, "verify"] for name in DECODE_DTYPES}


def valid_record(record: dict) -> bool:
    """Whether a stored record holds a finite positive time per dtype for each figure, and for each rung between
    one row and its key's rows (tlt_cli/tuning/cache.py)."""
    rungs = plain_rungs(record["key"]["rows"])[1:-1]
    tail = record.get("tail_step_ms")
    return (
        all(positive_figures(record.get(figure), DECODE_DTYPES) for figure in FIGURES)
        and isinstance(tail, dict)
        and set(tail) == {str(rung) for rung in rungs}
        and all(positive_figures(tail[str(rung)], DECODE_DTYPES) for rung in rungs)
    )


def _measured_record(policy: nn.Module, linear_plan: LinearFormPlan | None, rows: int) -> dict:
    plain, verify = measure_precision(policy, linear_plan, rows)
    rounded = {rung: {name: round(value, 3) for name, value in figures.items()} for rung, figures in plain.items()}
    rungs = plain_rungs(rows)
    return {
        "step_ms": rounded[1],
        "batch_step_ms": rounded[rungs[-1]],
        "tail_step_ms": {str(rung): rounded[rung] for rung in rungs[1:-1]},
        "verify_ms": {name: round(value, 3) for name, value in verify.items()},
    }


def _timed_passes(
    policy: nn.Module, dtype: torch.dtype, linear_plan: LinearFormPlan | None, rows: int
) -> dict[int | str, Callable[[], None]]:
    """A decode step at each running batch size of `plain_rungs(rows)` (by its rows) and a VERIFY_ROWS x
    VERIFY_TOKENS verify (`verify`), each with its logits, over a prefilled prefix of PREFIX_TOKENS (timing.py), one
    prefill for each row count."""
    model = decode_model_for(policy, dtype=dtype, linear_plan=linear_plan)
    prefix = random_prefix(policy, max(VERIFY_ROWS, rows), PREFIX_TOKENS)
    token_counts = {rung: [1] for rung in plain_rungs(rows)}
    token_counts.setdefault(VERIFY_ROWS, []).append(VERIFY_TOKENS)
    runs = {
        (row_count, tokens): run
        for row_count, counts in token_counts.items()
        for tokens, run in block_passes(model, prefix, row_count, tuple(counts)).items()
    }
    passes: dict[int | str, Callable[[], None]] = {rung: runs[rung, 1] for rung in plain_rungs(rows)}
    return passes | {"verify": runs[VERIFY_ROWS, VERIFY_TOKENS]}


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
