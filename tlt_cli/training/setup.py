"""The composition root's one setup: the only code that turns a Recipe into parts.

Every consumer of a recipe builds its parts here: the native worker (worker_loop.py), the TRL
worker (tlt_cli/integrations/trl_run.py), the driver's drafter preparation (tlt_cli/trainers.py),
`tlt profile <recipe>` (tlt_cli/profile/recording.py), `tlt calibrate`
(tlt_cli/calibration/calibrate.py) and `tlt export-drafter` (tlt_cli/export.py). The parts:
  policy_and_tokenizer / reference_policy   the recipe's model (the reference only with a KL term)
  task, sampling                            the task and the rollout's sampling settings
  speculative_plan                          the `speculative` section as a SpeculativePlan, its rule table
                                            parsed and checked here, the one place it is read
  drafter_needed, prepare_drafter,          whether a run needs a drafter (it speculates, or a plugin
  starting_drafter, fresh_drafter           trains one), its starting folder (a cached warm-up, whose
                                            draft vocabulary the warm-up chooses, or a saved folder),
                                            the drafter itself over a policy, and a freshly initialised one
                                            (also what a drafter that diverged is reset to)
  planned_run                               the run's plan (tuning/run_plan.py), made once by the driver before
                                            the workers start: the actor's update precision (update_precision.py,
                                            handed the policy's loader), the decode plan and the speculative plan;
                                            every rank is handed it, so no worker resolves a recipe choice
  decode_plan, decode_plan_for              how the embedded rollout decodes (rollout/decode_plan.py): the
                                            rollout dtype, the linear-form plan and, in speculative.mode auto,
                                            the pass costs; the one caller of tuning/'s measurements, for the
                                            run's plan (and, asked by a PlanRequest, for profile, calibrate and
                                            bench; decode_plan_for for a TRL script's rollout_func, which has
                                            no recipe)
  model_pair                                the one loader of a target and its starting drafter for every command
                                            that measures (rollout/model_pair.py), decoding by a decode plan
The RolloutBackend `rollout.backend` names is built from a recipe beside it, in rollout_backends.py.
Below this module nothing reads a recipe to build a part: the engines, backends and drafters
take explicit arguments.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tlt_cli.config import (
    CPU_DEVICES,
    DEFAULT_RULES,
    FRESH_DRAFTER_STARTS,
    Bfloat16Rounding,
    DrafterStart,
    LinearForms,
    Recipe,
    RolloutBackendName,
    RolloutDtype,
    SpeculativeSection,
)
from tlt_cli.engine.sampling import MIN_TEMPERATURE, SamplingParams
from tlt_cli.models.tiny import cache_directory
from tlt_cli.speculative.plan import SpeculationMode, SpeculativePlan
from tlt_cli.speculative.rules import Rule, RuleTableError, build_rules
from tlt_cli.speculative.types import SpeculativeConfig
from tlt_cli.training.drafter_use import drafter_needed, speculation_mode
from tlt_cli.training.update_precision import resolve_update_precision
from tlt_cli.tuning.run_plan import RunPlan

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from tlt_cli.drafter.loss import DrafterObjective
    from tlt_cli.drafter.model import EagleDrafter
    from tlt_cli.drafter.warmup import WarmupData, WarmupProgress, WarmupReport
    from tlt_cli.engine.linear_forms import LinearFormPlan
    from tlt_cli.rollout.decode_plan import DecodePlan
    from tlt_cli.rollout.model_pair import ModelPair
    from tlt_cli.tasks.base import Task


def model_cache(recipe: Recipe) -> Path:
    """Where built models, measured plans and compiled DeepSpeed ops are cached (model.cache_dir or the default)."""
    return cache_directory(recipe.model.cache_dir)


def policy_and_tokenizer(recipe: Recipe) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The recipe's model, freshly loaded, and its tokenizer."""
    from tlt_cli.models.loading import load_policy

    return load_policy(recipe.model.path, trust_remote_code=recipe.model.trust_remote_code)


def reference_policy(recipe: Recipe) -> PreTrainedModel | None:
    """A frozen copy of the starting policy for the KL term (None when actor.kl_coef is 0)."""
    return policy_and_tokenizer(recipe)[0].eval() if recipe.actor.kl_coef > 0 else None


def task(recipe: Recipe) -> Task:
    """The recipe's task, with its options, seeded by run.seed."""
    from tlt_cli.tasks.registry import build_task

    return build_task(recipe.task.name, recipe.run.seed, dict(recipe.task.options))


def sampling(recipe: Recipe) -> SamplingParams:
    """How the rollout samples (rollout.max_new_tokens, temperature, top_p, top_k)."""
    rollout = recipe.rollout
    return SamplingParams(
        max_new_tokens=rollout.max_new_tokens, temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k
    )


def speculative_plan(section: SpeculativeSection) -> SpeculativePlan:
    """The recipe's `speculative` section as plain values. The rule table is parsed and checked here, in mode
    adaptive (tlt's DEFAULT_RULES when the recipe gives none), and in mode auto when the recipe gives one (it then
    wins over the cost model: the plan's mode is adaptive); the other modes never read it: a RuleTableError
    naming speculative.rules and the rule, which
    the recipe checks (tlt_cli/recipe_checks.py) refuse the recipe with."""
    mode = speculation_mode(section)
    table = [dict(rule) for rule in section.rules]
    if mode == SpeculationMode.auto and table:  # a table the recipe gives wins over the cost model
        mode = SpeculationMode.adaptive
    rules: tuple[Rule, ...] = ()
    if mode == SpeculationMode.adaptive:
        try:
            rules = tuple(build_rules(table or [dict(rule) for rule in DEFAULT_RULES]))
        except RuleTableError as error:
            raise RuleTableError(f"speculative.rules: {error}") from None
    return SpeculativePlan(
        mode,
        SpeculativeConfig(section.steps, section.topk, section.draft_tokens),
        rules,
        section.collapse_accept_length,
        section.reprobe_steps,
        section.bandit_epsilon,
    )


def prepare_drafter(
    recipe: Recipe, cache: Path, progress: WarmupProgress | None = None, needed: bool | None = None
) -> tuple[Path | None, dict | None]:
    """(folder of the starting drafter or None for a fresh start, warm-up report if one ran now).

    With drafter.init auto the newest drafter tlt holds for the model (tlt_cli/drafter/library.py) when there is
    one, else a fresh start; online or random: a fresh start (no warm-up on the way to step 0). With
    drafter.init warmup the drafter is trained once on the target's own generations and cached
    under `cache` (tlt_cli/drafter/initial.py keys it), and published to the library; a warm-up that runs
    reports its phases to `progress` (tlt_cli/drafter/warmup.py). needed: whether a drafter is wanted (None:
    whether the run needs one; a benchmark of speculation wants one whatever the recipe's mode).
    """
    needed = drafter_needed(recipe) if needed is None else needed
    if not needed or recipe.drafter.init in FRESH_DRAFTER_STARTS:
        return None, None
    if recipe.drafter.init == DrafterStart.auto:
        return held_drafter(recipe, cache), None
    if recipe.drafter.init != DrafterStart.warmup:
        return Path(recipe.drafter.init), None
    return warmed_up_drafter(recipe, cache, progress)


def warmed_up_drafter(recipe: Recipe, cache: Path, progress: WarmupProgress | None = None) -> tuple[Path, dict | None]:
    """(folder, report) of the recipe's offline warm-up (`drafter.init: warmup`, `tlt drafter warmup`): read from
    the cache (report None), or run now, saved there and published to the library as the model's newest drafter.
    A warm-up that runs trains the drafter tlt holds for the model further when there is one (on prompts of
    its own), else a fresh one. Stopped after its sampling, it keeps what it sampled, and the next one trains on
    it."""
    from tlt_cli.drafter.initial import cached_warmup, warmup_folder

    folder = warmup_folder(recipe, cache)
    if cached_warmup(folder):
        return folder, None
    report = warm_up_into(recipe, folder, progress, held_drafter(recipe, cache))
    publish_drafter(
        recipe,
        cache,
        folder,
        f"the warm-up of {recipe.run.name}",
        accept_length=report["held_out_accept_length"],
        acceptance=report["held_out_acceptance"],
    )
    return folder, report


def describe_drafter_start(recipe: Recipe, folder: Path | None) -> str | None:
    """The console's one line on where the run's drafter starts (`folder`: what prepare_drafter gave), with the
    accept length it was last measured at when tlt holds it; None when the run needs no drafter."""
    from tlt_cli.drafter.library import record_of

    if not drafter_needed(recipe):
        return None
    init = recipe.drafter.init
    if folder is None and init in (DrafterStart.auto, DrafterStart.online):
        held = "none held for this model yet: " if init == DrafterStart.auto else ""
        return (
            f"drafter: {held}a fresh one, drafting model-free n-grams until it pays, trained online; tlt keeps it for "
            "the next run on this model (drafter.init=warmup trains one before step 0)"
        )
    if folder is None:
        return f"drafter: a fresh one (drafter.init {init})"
    record = record_of(folder)
    kind = "the newest drafter tlt holds for this model" if init == DrafterStart.auto else f"drafter.init {init}"
    return f"drafter: {kind}, {record.describe() if record else 'never measured in a run'} ({folder})"


def held_drafter(recipe: Recipe, cache: Path) -> Path | None:
    """The folder of the newest drafter tlt holds for the recipe's model (drafter/library.py), or None (none held,
    or no model folder yet: loading the model refuses that in one sentence, where it is needed)."""
    from tlt_cli.drafter import library
    from tlt_cli.models.loading import ModelLoadError, model_folder

    try:
        folder = model_folder(recipe.model.path)
    except ModelLoadError:
        return None
    held = library.newest(cache, folder)
    return held[0] if held is not None else None


def publish_drafter(
    recipe: Recipe,
    cache: Path,
    drafter_folder: Path,
    source: str,
    accept_length: float | None = None,
    acceptance: float | None = None,
    model_path: str | None = None,
) -> Path:
    """Make the drafter saved in `drafter_folder` the newest one held for the recipe's model (or `model_path`'s:
    an exported policy), recording its source and how well it drafted at the rollout's temperature."""
    from tlt_cli.drafter import library
    from tlt_cli.models.loading import model_folder

    record = library.DrafterRecord(
        source=source,
        model=model_path or recipe.model.path,
        accept_length=accept_length,
        acceptance=acceptance,
        temperature=recipe.rollout.temperature,
    )
    return library.publish(cache, model_folder(model_path or recipe.model.path), drafter_folder, record)


def warm_up_into(recipe: Recipe, folder: Path, progress: WarmupProgress | None, start: Path | None = None) -> dict:
    """Run the recipe's offline warm-up (drafter/warmup.py) and save its drafter in `folder`; its report. It trains
    the drafter saved in `start` further (a fresh one when None), sampling prompts from `first_warmup_prompt`. The
    target samples in `warmup_dtype`; what it sampled is kept beside `folder` until the drafter is saved, so a
    warm-up stopped in training resumes there."""
    from tlt_cli.drafter.initial import first_warmup_prompt
    from tlt_cli.drafter.library import record_of
    from tlt_cli.drafter.model import load_drafter, save_drafter
    from tlt_cli.drafter.warmup import (
        FRESH_START,
        HELD_OUT_PROMPTS,
        collect_warmup_data,
        load_warmup_data,
        save_warmup_data,
    )

    target, tokenizer = policy_and_tokenizer(recipe)
    data_path = folder.with_name(f"{folder.name}.samples.pt")
    data = load_warmup_data(data_path)
    if data is None:
        data = collect_warmup_data(
            target,
            tokenizer,
            task(recipe),
            recipe.drafter.warmup_prompts,
            HELD_OUT_PROMPTS,
            SamplingParams(
                max_new_tokens=recipe.rollout.max_new_tokens,
                temperature=max(recipe.rollout.temperature, MIN_TEMPERATURE),  # greedy runs warm up sampling
            ),
            recipe.run.seed,
            progress,
            warmup_dtype(recipe, target.device),
            first_warmup_prompt(start, recipe.drafter.warmup_prompts + HELD_OUT_PROMPTS),
        )
        folder.parent.mkdir(parents=True, exist_ok=True)
        save_warmup_data(data, data_path)
    drafter, report = train_recipe_drafter(
        recipe,
        target,
        tokenizer,
        data,
        recipe.drafter.warmup_steps,
        drafter_objective(recipe),
        progress,
        load_drafter(start, target) if start is not None else None,
    )
    save_drafter(drafter, folder)
    data_path.unlink(missing_ok=True)
    record = record_of(start) if start is not None else None
    started_from = FRESH_START if start is None else f"the drafter tlt held, {record.describe() if record else start}"
    return {**asdict(report), "started_from": started_from}


def train_recipe_drafter(
    recipe: Recipe,
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    data: WarmupData,
    steps: int,
    objective: DrafterObjective,
    progress: WarmupProgress | None = None,
    start: EagleDrafter | None = None,
) -> tuple[EagleDrafter, WarmupReport]:
    """The warm-up's training (drafter/warmup.py `train_warmup_drafter`) on collected `data` with the recipe's
    drafter settings (batch, learning rate, draft vocabulary, seed), `steps` steps of `objective`, from `start`
    (None: a fresh drafter); the warm-up's and the drafter benchmarks' one way to train."""
    from tlt_cli.drafter.warmup import train_warmup_drafter

    settings = recipe.drafter
    return train_warmup_drafter(
        target,
        tokenizer,
        data,
        steps=steps,
        batch_size=settings.warmup_batch_size,
        lr=settings.warmup_lr,
        seed=recipe.run.seed,
        draft_vocab_size=settings.vocab_size,
        objective=objective,
        progress=progress,
        start=start,
    )


def warmup_dtype(recipe: Recipe, device: torch.device) -> torch.dtype:
    """What the warm-up samples in: the rollout's dtype when the recipe gives one; with `auto`, bfloat16 on a
    GPU or a CPU with bfloat16 units (BENCHMARKS.md: 2.1x float32's tokens/s on an avx512_bf16 EPYC), else
    float32. Its hidden states train the drafter in float32 either way."""
    import torch

    from tlt_cli.tuning.cache import matrix_flags

    if recipe.rollout.dtype != RolloutDtype.auto:
        return getattr(torch, recipe.rollout.dtype.value)
    if device.type == "cuda" or {"avx512_bf16", "amx_bf16"} & set(matrix_flags()):
        return torch.bfloat16
    return torch.float32


def drafter_objective(recipe: Recipe) -> DrafterObjective:
    """The drafter's objective (drafter.loss) at the rollout's sampling temperature, over drafter.train_depths."""
    from tlt_cli.drafter.loss import objective_named

    return objective_named(recipe.drafter.loss, recipe.rollout.temperature, recipe.drafter.train_depths)


def starting_drafter(recipe: Recipe, folder: Path | None, policy: PreTrainedModel) -> EagleDrafter:
    """A drafter over `policy` (it shares its embedding, norm and lm_head): loaded from `folder` (what
    `prepare_drafter` gave: tlt's layout or an EAGLE folder `tlt export-drafter` wrote, training/drafter_folder.py), or
    freshly initialised from run.seed: with drafter.init online over the task
    prompts' vocabulary (drafter/online_start.py), with random over the whole vocabulary."""
    from tlt_cli.training.drafter_folder import load_named_drafter

    if folder is not None:
        return load_named_drafter(folder, policy)
    return fresh_drafter(recipe, policy)


def fresh_drafter(recipe: Recipe, policy: PreTrainedModel) -> EagleDrafter:
    """A drafter over `policy` freshly initialised from run.seed: over the whole vocabulary with drafter.init random,
    else as drafter.init online builds it, over the task prompts' vocabulary (drafter/online_start.py). A run's
    starting drafter without a folder, and the one a drafter that diverged is reset to
    (training/drafter_divergence.py)."""
    from tlt_cli.drafter.model import EagleDrafter

    if recipe.drafter.init == DrafterStart.random:
        return EagleDrafter(policy, seed=recipe.run.seed)
    from tlt_cli.drafter.online_start import online_drafter
    from tlt_cli.models.loading import load_config_and_tokenizer

    _, tokenizer = load_config_and_tokenizer(recipe.model.path, trust_remote_code=recipe.model.trust_remote_code)
    return online_drafter(policy, tokenizer, task(recipe), recipe.drafter.vocab_size, recipe.run.seed)


def model_pair(
    recipe: Recipe, decode: DecodePlan, drafter_folder: Path | None
) -> tuple[ModelPair, PreTrainedTokenizerBase]:
    """The one loader of a target and its starting drafter for every command that measures (`tlt calibrate`,
    `tlt bench`): the recipe's model on the first actor device in the dtype of the actor's weights, the drafter
    `starting_drafter` makes from `drafter_folder` (what prepare_drafter gave) over it, decoding by `decode`
    (`decode_plan`); and the tokenizer."""
    from tlt_cli.rollout.model_pair import ModelPair
    from tlt_cli.training.actor import policy_dtype

    dtype = policy_dtype(recipe.actor)
    device = _decode_device(recipe)
    target, tokenizer = policy_and_tokenizer(recipe)
    target = target.to(device, dtype).eval()
    drafter = starting_drafter(recipe, drafter_folder, target).to(device, dtype).eval()
    pair = ModelPair(target, drafter, tokenizer.pad_token_id, tokenizer.eos_token_id, device, decode)
    return pair, tokenizer


def planned_run(recipe: Recipe, drafter_folder: Path | None) -> tuple[Recipe, RunPlan]:
    """The run's plan (tlt_cli/tuning/run_plan.py), made once by the driver before any worker starts, and the
    recipe with the choice it made written in (actor.precision concrete: what the workers and recipe.yaml hold);
    `drafter_folder`: the starting drafter's (prepare_drafter)."""
    recipe, update = resolve_update_precision(recipe, model_cache(recipe), lambda: policy_and_tokenizer(recipe)[0])
    return recipe, RunPlan(update, decode_plan(recipe, drafter_folder), speculative_plan(recipe.speculative))


@dataclass(frozen=True)
class PlanRequest:
    """What a command that measures asks of the decode plan beyond the recipe; each None: as `tlt train` plans it.
    rows: the sequences one rollout call decodes (None: a worker's of one step); dtype: the rollout dtype (None:
    rollout.dtype); speculates: whether the rollout's tail is weighed as verify passes, with the drafter's shapes
    (None: whether the recipe speculates); costs: whether the pass costs are measured (None: in speculative.mode
    auto, when the rollout speculates)."""

    rows: int | None = None
    dtype: RolloutDtype | None = None
    speculates: bool | None = None
    costs: bool | None = None


def decode_plan(recipe: Recipe, drafter_folder: Path | None = None, request: PlanRequest = PlanRequest()) -> DecodePlan:
    """How the recipe's embedded rollout decodes (rollout/decode_plan.py), measured with the thread count and on
    the device a worker decodes with; `drafter_folder`: the starting drafter's (prepare_drafter), whose shapes the
    linear forms and pass costs cover; `request`: what a measuring command asks beyond the recipe (PlanRequest).
    The measurements are keyed by the model's shapes (models/loading.py `unloaded_policy`): its weights are read
    only when one is not cached yet. An SGLang rollout decodes in its servers: nothing is measured."""
    from tlt_cli.rollout.decode_plan import DecodePlan

    if recipe.rollout.backend == RolloutBackendName.sglang:
        return DecodePlan(
            precision={"dtype": str(recipe.rollout.sglang.dtype), "reason": "given: rollout.sglang.dtype"}
        )
    if recipe.rollout.backend != RolloutBackendName.embedded:  # TRL's own generation, in the trainer's dtype
        return DecodePlan()
    mode = speculation_mode(recipe.speculative)
    speculates = mode != SpeculationMode.off if request.speculates is None else request.speculates
    costs = mode == SpeculationMode.auto and speculates if request.costs is None else request.costs
    dtype = request.dtype or recipe.rollout.dtype
    stochastic_rounding = recipe.actor.bfloat16_rounding == Bfloat16Rounding.stochastic
    if dtype != RolloutDtype.auto and recipe.rollout.linear_forms == LinearForms.off and not costs:
        # nothing to measure: the model is not loaded here
        return _given_decode_plan(dtype, stochastic_rounding)
    from tlt_cli.models.loading import unloaded_policy
    from tlt_cli.tuning.cache import RecordMissing, only_cached
    from tlt_cli.tuning.threads import torch_threads

    device = _decode_device(recipe)
    measured = _Measured(request.rows or recipe.samples_per_worker, dtype, speculates, costs)
    with torch_threads(recipe.workers.threads_per_worker):
        try:  # the model's shapes key the cached measurements: its weights are read only if one is missing
            with only_cached():
                unloaded = unloaded_policy(recipe.model.path, device, trust_remote_code=recipe.model.trust_remote_code)
                return _measured_decode_plan(recipe, unloaded, drafter_folder, measured)
        except RecordMissing:
            policy = policy_and_tokenizer(recipe)[0].to(device).eval()
            return _measured_decode_plan(recipe, policy, drafter_folder, measured)


@dataclass(frozen=True)
class _Measured:
    """A PlanRequest resolved against the recipe: what `_measured_decode_plan` measures for."""

    rows: int
    dtype: RolloutDtype
    speculates: bool
    costs: bool


def _measured_decode_plan(
    recipe: Recipe, policy: nn.Module, drafter_folder: Path | None, measured: _Measured
) -> DecodePlan:
    """`decode_plan_for` the recipe's settings, over `policy` and the starting drafter on it (when the rollout
    speculates, or a plugin trains one)."""
    needs_drafter = measured.speculates or drafter_needed(recipe)
    drafter = starting_drafter(recipe, drafter_folder, policy) if needs_drafter else None
    return decode_plan_for(
        policy,
        drafter,
        dtype=measured.dtype,
        linear_forms=recipe.rollout.linear_forms,
        cache_dir=model_cache(recipe),
        rows=measured.rows,
        speculates=measured.speculates,
        costs=measured.costs,
        stochastic_rounding=recipe.actor.bfloat16_rounding == Bfloat16Rounding.stochastic,
    )


def decode_plan_for(
    policy: nn.Module,
    drafter: nn.Module | None,
    dtype: RolloutDtype | str,
    linear_forms: LinearForms | str,
    cache_dir: Path,
    rows: int,
    speculates: bool,
    costs: bool,
    correctable: bool = True,
    stochastic_rounding: bool = True,
) -> DecodePlan:
    """`decode_plan` from plain values (a TRL script's rollout_func has no recipe): the linear-form plan for the
    policy and drafter, the dtype for a rollout of `rows` rows (its tail speculating or not) and, when `costs`,
    the pass costs in that dtype. correctable: whether the learner corrects the rollout/learner mismatch (False: a
    user's own TRL GRPOTrainer; `auto` then keeps the policy's dtype); stochastic_rounding: how bfloat16 copies of
    float32 weights round (actor.bfloat16_rounding)."""
    from tlt_cli.rollout.decode_plan import DecodePlan
    from tlt_cli.tuning.linear_forms import measured_linear_plan
    from tlt_cli.tuning.pass_costs import measured_pass_costs
    from tlt_cli.tuning.precision import RolloutWorkload, rollout_precision

    linear_plan = measured_linear_plan(linear_forms, [policy, drafter], cache_dir)
    workload = RolloutWorkload(rows, speculates)
    precision = rollout_precision(dtype, policy, linear_plan, cache_dir, workload, correctable, stochastic_rounding)
    pass_costs = (
        measured_pass_costs(
            policy, drafter, precision.torch_dtype, linear_plan, cache_dir, rows, precision.shared_pass_ms()
        )
        if costs
        else None
    )
    lines = [precision.describe()]
    if linear_plan is not None:
        lines.append(linear_forms_line(linear_plan))
    if pass_costs is not None:
        lines.append(pass_costs.describe())
    return DecodePlan(
        precision.dtype, linear_plan, pass_costs, precision.to_record(), tuple(lines), stochastic_rounding
    )


def linear_forms_line(linear_plan: LinearFormPlan) -> str:
    """The linear-form plan in one short line for the console: how many weight shapes leave `linear` at some batch
    size (engine/linear_forms.py `describe_plan` gives every shape's forms per batch size)."""
    from tlt_cli.engine.linear_forms import LINEAR

    changed = sum(any(name != LINEAR for name in names) for names in linear_plan.forms.values())
    if not changed:
        return f"linear forms: {LINEAR} for every weight shape (measured once per machine and model)"
    return (
        f"linear forms: {changed} of {len(linear_plan.forms)} weight shapes use a faster form than {LINEAR} at some "
        "batch sizes (measured once per machine and model)"
    )


def _given_decode_plan(dtype: RolloutDtype, stochastic_rounding: bool) -> DecodePlan:
    """The plan of a rollout whose dtype the recipe names, with plain linear forms and no pass costs."""
    from tlt_cli.rollout.decode_plan import DecodePlan
    from tlt_cli.tuning.precision import PrecisionChoice

    choice = PrecisionChoice(dtype.value, "given", {}, {})
    return DecodePlan(
        dtype.value,
        precision=choice.to_record(),
        log_lines=(choice.describe(),),
        stochastic_rounding=stochastic_rounding,
    )


def _decode_device(recipe: Recipe):
    """Where a worker decodes: its GPU (the first of actor.devices stands for all), or the CPU."""
    import torch

    if recipe.actor.devices == CPU_DEVICES:
        return torch.device("cpu")
    devices = recipe.actor.devices
    return torch.device("cuda", int(devices[0] if isinstance(devices, (list, tuple)) else devices))
