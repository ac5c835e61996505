"""The rollout's precision: float32 or bfloat16, chosen by measurement per machine and model, and cached.

Speculative decoding pays when verifying a block of drafted tokens costs about one decode step. On matrix
units (GPU tensor cores, CPUs with AMX) that holds in bfloat16 and not in float32 (a 16-token verify of
SmolLM2-135M on an AMX Xeon: 1.21x a 1-row step in bfloat16, 2.46x in float32); on other CPUs bfloat16
gains little, and a bfloat16 rollout samples from a slightly different policy than the float32 learner
(tlt_cli/training measures and corrects that). So the dtype is measured, not assumed:

    choice = rollout_precision("auto", policy, linear_plan, cache_dir)   # PrecisionChoice
    decode_model_for(policy, dtype=choice.torch_dtype, linear_plan=linear_plan)
    print(choice.describe())      # for the run log; choice.to_record() for the trace

`float32` and `bfloat16` are taken as given. `auto` reads the choice cached for this machine and model, or
measures it first (about 2 s for SmolLM2-135M, milliseconds for the built-in tiny model): the owned decode
forward of `policy` (tlt_cli/engine/llama_family.py) in each dtype, float32 with the measured linear-form
plan a worker uses, times a 1-row decode step and a 16-token verify pass (4 rows x 4 tokens), logits
included, over a 64-token prefix, in interleaved rounds (best CPU time counts, so load from other processes
moves it little). bfloat16 is chosen when it makes
the plain step at least MARGIN faster, or when it makes verification cheap (a verify at most CHEAP_VERIFY
steps, and at least MARGIN cheaper than float32's) without making the plain step more than TOLERANCE slower.
A model outside the owned family decodes through transformers in its own dtype: `auto` keeps it.

Cache: `<cache_dir>/rollout_precision/<hash>.json`, keyed by the machine (tuning/cache.py), the model's
shapes and the linear-form plan, written atomically under a file lock so concurrent ranks measure once.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from tlt_cli.engine import decode_model_for
from tlt_cli.engine.linear_forms import LinearFormPlan
from tlt_cli.engine.llama_family import refusal
from tlt_cli.tuning.cache import cached_record, machine_key

ROLLOUT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ROLLOUT_DTYPE_SETTINGS = ("auto", *ROLLOUT_DTYPES)
CACHE_FOLDER = "rollout_precision"
MEASUREMENT_FORMAT = 1
ROUNDS = 5
# each timing repeats its pass until it lasts about this long (CPU milliseconds)
SHORTEST_TIMING_MS = 20.0
PREFIX_TOKENS = 64
VERIFY_ROWS, VERIFY_TOKENS = 4, 4
# bfloat16 must be this much faster (plain step, or verify) to be chosen: its samples differ from float32's
MARGIN = 0.1
# a verify pass of VERIFY_ROWS x VERIFY_TOKENS tokens costing at most this many 1-row steps is "cheap"
CHEAP_VERIFY = 1.5
# bfloat16 chosen for cheap verification may make the plain 1-row step at most this much slower
TOLERANCE = 0.05


@dataclass(frozen=True)
class PrecisionChoice:
    """The rollout's dtype and why: `given` (the recipe named it), `measured` (auto, figures below) or
    `model dtype` (auto on a model the owned forward does not decode). step_ms / verify_ms: per dtype
    name, the best 1-row decode step and 16-token verify, in milliseconds (empty unless measured)."""

    dtype: str
    reason: str
    step_ms: dict[str, float]
    verify_ms: dict[str, float]

    @property
    def torch_dtype(self) -> torch.dtype:
        return ROLLOUT_DTYPES[self.dtype]

    def describe(self) -> str:
        """One line for the run log: the dtype and the figures that chose it."""
        measured = [name for name in self.step_ms if self.step_ms[name] > 0 and name in self.verify_ms]
        if not measured:
            return f"rollout dtype: {self.dtype} ({self.reason})"
        figures = "; ".join(
            f"{name} step {self.step_ms[name]:.1f} ms, 16-token verify {self.verify_ms[name]:.1f} ms "
            f"({self.verify_ms[name] / self.step_ms[name]:.2f}x a step)"
            for name in measured
        )
        return f"rollout dtype: {self.dtype} ({self.reason}: {figures})"

    def to_record(self) -> dict:
        """What the trace's run record and `tlt profile` carry."""
        return asdict(self)


def rollout_precision(
    setting: str, policy: nn.Module, linear_plan: LinearFormPlan | None, cache_dir: Path
) -> PrecisionChoice:
    """The dtype the rollout decodes `policy` in, for the recipe's `rollout.dtype` (see the module docstring)."""
    if setting not in ROLLOUT_DTYPE_SETTINGS:
        raise ValueError(f"rollout.dtype is '{setting}'; use one of {', '.join(ROLLOUT_DTYPE_SETTINGS)}.")
    if setting != "auto":
        return PrecisionChoice(setting, "given", {}, {})
    reason = refusal(policy)
    if reason is not None:
        own = str(policy.get_input_embeddings().weight.dtype).removeprefix("torch.")
        return PrecisionChoice(own if own in ROLLOUT_DTYPES else "float32", "model dtype: transformers path", {}, {})
    key = {"format": MEASUREMENT_FORMAT, **machine_key(_device_of(policy)), "model": _model_key(policy, linear_plan)}
    record, _ = cached_record(cache_dir, CACHE_FOLDER, key, lambda: _measured_record(policy, linear_plan))
    return PrecisionChoice(**{field: record[field] for field in ("dtype", "reason", "step_ms", "verify_ms")})


def choose_dtype(step_ms: dict[str, float], verify_ms: dict[str, float]) -> str:
    """bfloat16 when it makes the plain step faster, or verification cheap without slowing the step; else float32."""
    plain_gain = step_ms["float32"] / step_ms["bfloat16"]
    verify_gain = verify_ms["float32"] / verify_ms["bfloat16"]
    verify_in_steps = verify_ms["bfloat16"] / step_ms["bfloat16"]
    if plain_gain >= 1 + MARGIN:
        return "bfloat16"
    cheap_verify = verify_in_steps <= CHEAP_VERIFY and verify_gain >= 1 + MARGIN
    return "bfloat16" if cheap_verify and plain_gain >= 1 - TOLERANCE else "float32"


def measure_precision(
    policy: nn.Module, linear_plan: LinearFormPlan | None, rounds: int = ROUNDS
) -> tuple[dict[str, float], dict[str, float]]:
    """(1-row step ms, 16-token verify ms) per dtype name: the owned forward's best of `rounds` interleaved rounds."""
    passes = {name: _timed_passes(policy, dtype, linear_plan) for name, dtype in ROLLOUT_DTYPES.items()}
    step_ms = dict.fromkeys(ROLLOUT_DTYPES, float("inf"))
    verify_ms = dict.fromkeys(ROLLOUT_DTYPES, float("inf"))
    with torch.no_grad():
        repeats = {name: (_repeats(step), _repeats(verify)) for name, (step, verify) in passes.items()}
        for _ in range(rounds):
            for name, (step, verify) in passes.items():
                step_ms[name] = min(step_ms[name], _milliseconds(step, repeats[name][0]))
                verify_ms[name] = min(verify_ms[name], _milliseconds(verify, repeats[name][1]))
    return step_ms, verify_ms


def _measured_record(policy: nn.Module, linear_plan: LinearFormPlan | None) -> dict:
    step_ms, verify_ms = measure_precision(policy, linear_plan)
    rounded = {
        name: {key: round(value, 3) for key, value in figures.items()}
        for name, figures in (("step_ms", step_ms), ("verify_ms", verify_ms))
    }
    return {"dtype": choose_dtype(step_ms, verify_ms), "reason": "measured", **rounded}


def _timed_passes(
    policy: nn.Module, dtype: torch.dtype, linear_plan: LinearFormPlan | None
) -> tuple[Callable[[], None], Callable[[], None]]:
    """(a 1-row decode step, a VERIFY_ROWS x VERIFY_TOKENS verify), each with its logits, over a prefilled prefix
    of PREFIX_TOKENS; both write past the prefix, so repeating them measures the same pass."""
    model = decode_model_for(policy, dtype=dtype, linear_plan=linear_plan)
    device = _device_of(policy)
    vocabulary = policy.get_input_embeddings().weight.shape[0]
    generator = torch.Generator(device=device).manual_seed(0)
    prefix = torch.randint(vocabulary, (VERIFY_ROWS, PREFIX_TOKENS), generator=generator, device=device)

    def block_pass(rows: int, tokens: int) -> Callable[[], None]:
        cache = model.new_cache(rows, PREFIX_TOKENS + tokens)
        positions = torch.arange(PREFIX_TOKENS, device=device).expand(rows, PREFIX_TOKENS)
        causal = torch.ones(PREFIX_TOKENS, PREFIX_TOKENS, dtype=torch.bool, device=device).tril()
        with torch.no_grad():
            model.forward_block(
                cache, prefix[:rows], positions, positions, PREFIX_TOKENS, causal.expand(rows, 1, -1, -1)
            )
        kv_length = PREFIX_TOKENS + tokens
        visible = torch.ones(tokens, kv_length, dtype=torch.bool, device=device)
        visible[:, PREFIX_TOKENS:] = torch.ones(tokens, tokens, dtype=torch.bool, device=device).tril()
        visible = visible.expand(rows, 1, -1, -1)
        block_positions = (PREFIX_TOKENS + torch.arange(tokens, device=device)).expand(rows, tokens)
        block_ids = prefix[:rows, :tokens]

        def run() -> None:
            hidden = model.forward_block(cache, block_ids, block_positions, block_positions, kv_length, visible)
            model.logits(hidden)

        return run

    return block_pass(1, 1), block_pass(VERIFY_ROWS, VERIFY_TOKENS)


def _milliseconds(run: Callable[[], None], repeats: int) -> float:
    """CPU milliseconds of one `run()`, averaged over `repeats` back-to-back calls (process CPU time: the time this
    process computed, not the time it waited for a core on a loaded machine)."""
    started = time.process_time()
    for _ in range(repeats):
        run()
    return (time.process_time() - started) * 1e3 / repeats


def _repeats(run: Callable[[], None]) -> int:
    """How many back-to-back calls of `run` last about SHORTEST_TIMING_MS (tiny models' passes take microseconds)."""
    once = _milliseconds(run, 1)
    return max(1, math.ceil(SHORTEST_TIMING_MS / max(once, 1e-3)))


def _model_key(policy: nn.Module, linear_plan: LinearFormPlan | None) -> dict:
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


def _device_of(policy: nn.Module) -> torch.device:
    return next(policy.parameters()).device
