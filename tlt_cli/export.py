"""`tlt export-drafter`: write a trained drafter as a Hugging Face-style folder SGLang serves as an EAGLE draft.

`export_drafter(source, output_dir, ...)` reads a drafter saved by `save_drafter` (a drafter folder,
a run checkpoint's `drafter/`, or a run directory's latest checkpoint), measures its greedy accept
length on held-out prompts of the run's task with tlt's embedded engine, and writes
  config.json          the drafter in SGLang's EAGLE format (tlt_cli/sglang/drafter_format.py):
  model.safetensors    the target's config with one layer; the tensors, with include_shared the target's
                       embed_tokens.weight / lm_head.weight too
  README.md            the model card: target, RL step, accept length, serving command, known differences
  tlt_export.json      what was measured, for `load_exported_drafter` and scripts
  token_map.pt         only for a reduced draft vocabulary: its target ids, for `--speculative-token-map`
into a temporary sibling folder, reloads that folder into the embedded engine (`load_exported_drafter`),
checks it reproduces the same accepted tokens, and only then renames it into place, so a full disk
or a failed check leaves nothing half-written. A non-empty output folder is replaced only with
force, and only when it is a previous export (its files are the four above); the source, or any
folder holding it, is never the output. An output that is a symbolic link is written through (the
link stays); one whose target is missing is refused.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import save
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from tlt_cli.checkpoint import (
    DRAFTER_DIRECTORY,
    STATE_FILE,
    CheckpointError,
    checked_state,
    latest_checkpoint,
)
from tlt_cli.config import Recipe
from tlt_cli.drafter.model import CONFIG_FILE, DrafterLoadError, load_drafter
from tlt_cli.drafter.warmup import encode_prompts
from tlt_cli.engine.sampling import SamplingParams
from tlt_cli.errors import UserError, writing
from tlt_cli.export_policy import WRITE_ADVICE, policy_at_checkpoint
from tlt_cli.recipe_checks import load_checked_recipe
from tlt_cli.rollout.generate_loop import EmbeddedEngine
from tlt_cli.rollout.types import RolloutRequest
from tlt_cli.sglang.drafter_format import CONFIG_FILE as EXPORT_CONFIG_FILE
from tlt_cli.sglang.drafter_format import (
    SGLANG_VERSIONS_CHECKED,
    TOKEN_MAP_FILE,
    WEIGHTS_FILE,
    DrafterFormatError,
    load_exported_drafter,
    save_token_map,
    sglang_architecture,
    sglang_config,
    sglang_tensors,
)
from tlt_cli.speculative.decoder import SpeculativeDecoder
from tlt_cli.speculative.types import MAX_DRAFT_STEPS, SpeculativeConfig, accept_length
from tlt_cli.training import setup
from tlt_cli.training.actor import CHECKPOINT_TAG

SUMMARY_FILE = "tlt_export.json"
# the most held-out prompts --prompts measures acceptance on (each is decoded alone)
MAX_PROBE_PROMPTS = 10_000
CARD_FILE = "README.md"
# every file an export holds: a folder of these (with SUMMARY_FILE) is one --force may replace
EXPORT_FILES = frozenset({EXPORT_CONFIG_FILE, WEIGHTS_FILE, CARD_FILE, SUMMARY_FILE, TOKEN_MAP_FILE})


class ExportError(DrafterFormatError):
    """A drafter that cannot be exported as asked; the message says what to fix."""


@dataclass(frozen=True)
class DrafterSource:
    """Where the drafter and its target come from."""

    drafter_dir: Path
    recipe: Recipe
    # the RL step the checkpoint was written after, counted from 0 as the trace counts (step_000003: 2; None for a
    # drafter folder outside a run)
    rl_step: int | None
    # the checkpoint whose actor weights are the target (None: the recipe's model as it is)
    checkpoint_dir: Path | None
    # set when the run's `latest` checkpoint was damaged and an earlier one is exported
    warning: str | None = None


@dataclass(frozen=True)
class HeldOutProbe:
    """How acceptance is measured: prompt_ids [N][P_i] of held-out problems, greedy, chain of draft_steps."""

    prompt_ids: list[list[int]]
    first_problem_index: int
    eos_token_id: int
    pad_token_id: int
    max_new_tokens: int
    draft_steps: int


@dataclass(frozen=True)
class AcceptMeasurement:
    """Greedy SD over held-out prompts, one at a time; accept_length = (accepted + passes) / passes."""

    accept_length: float
    verify_passes: int
    accepted_draft_tokens: int
    accepted_by_depth: list[int]
    proposed_by_depth: list[int]
    prompts: int
    first_problem_index: int
    draft_steps: int
    max_new_tokens: int


@dataclass(frozen=True)
class ExportSummary:
    output_dir: str
    architecture: str
    target: str
    rl_step: int | None
    include_shared: bool
    measurement: AcceptMeasurement
    reloaded_accept_length: float
    files: list[str]
    # one line each, for the terminal (a damaged latest checkpoint replaced by the previous one)
    warnings: list[str]


def export_drafter(
    source: Path,
    output_dir: Path,
    recipe_path: Path | None = None,
    include_shared: bool = False,
    force: bool = False,
    prompts: int = 8,
    max_new_tokens: int | None = None,
    draft_steps: int = 4,
    tell: Callable[[str], None] = lambda line: None,
) -> ExportSummary:
    """Export, validate by reloading, then rename into place (see the module docstring); `tell` hears what it
    measures before it measures (minutes on CPU)."""
    output_dir = Path(output_dir)
    folder = _check_output(output_dir, force, Path(source))
    drafter_source = resolve_source(Path(source), recipe_path)
    tell(loading_sentence(drafter_source))
    target, tokenizer = load_target(drafter_source)
    try:
        drafter = load_drafter(drafter_source.drafter_dir, target)
    except DrafterLoadError as error:
        raise ExportError(str(error)) from None
    probe = held_out_probe(drafter_source.recipe, tokenizer, prompts, max_new_tokens, draft_steps)
    tell(
        f"measuring the drafter's accept length on {prompts} held-out prompts, one at a time, up to "
        f"{probe.max_new_tokens} new tokens each with {draft_steps} draft tokens a verify pass, then again on the "
        "reloaded export (minutes on CPU)"
    )
    measurement = measure_accept_length(target, drafter, probe)
    # created like any folder (the umask decides its mode), under a name no other export uses
    staging = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    with writing(output_dir, WRITE_ADVICE, ExportError):
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
    try:
        _write_file(staging / WEIGHTS_FILE, save(sglang_tensors(drafter, target, include_shared)))
        _write_file(staging / EXPORT_CONFIG_FILE, json.dumps(sglang_config(drafter, target), indent=2) + "\n")
        files = [EXPORT_CONFIG_FILE, WEIGHTS_FILE, CARD_FILE, SUMMARY_FILE]
        if drafter.vocabulary.is_reduced:
            with writing(output_dir, WRITE_ADVICE, ExportError):
                save_token_map(drafter.vocabulary, staging / TOKEN_MAP_FILE)
            files.append(TOKEN_MAP_FILE)
        tell(f"accept length {measurement.accept_length:.3f}; measuring the reloaded export on the same prompts")
        reloaded = measure_accept_length(target, load_exported_drafter(staging, target), probe)
        _check_reproduced(measurement, reloaded, output_dir)
        summary = ExportSummary(
            output_dir=str(output_dir),
            architecture=sglang_architecture(target),
            target=target_description(drafter_source, target),
            rl_step=drafter_source.rl_step,
            include_shared=include_shared,
            measurement=measurement,
            reloaded_accept_length=reloaded.accept_length,
            files=files,
            warnings=[drafter_source.warning] if drafter_source.warning else [],
        )
        _write_file(staging / SUMMARY_FILE, json.dumps(asdict(summary), indent=2) + "\n")
        _write_file(staging / CARD_FILE, model_card(summary, drafter_source, drafter.config))
        with writing(output_dir, WRITE_ADVICE, ExportError):
            _replace_directory(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return summary


def _write_file(path: Path, content: bytes | str) -> None:
    """Write one file of the staged export; a full disk is an ExportError naming the file."""
    with writing(path, WRITE_ADVICE, ExportError):
        path.write_bytes(content.encode("utf-8") if isinstance(content, str) else content)


def _check_reproduced(measurement: AcceptMeasurement, reloaded: AcceptMeasurement, output_dir: Path) -> None:
    if (reloaded.verify_passes, reloaded.accepted_draft_tokens) != (
        measurement.verify_passes,
        measurement.accepted_draft_tokens,
    ):
        raise ExportError(
            f"the exported drafter reloaded into tlt accepts {reloaded.accept_length:.3f} tokens per pass, not the "
            f"{measurement.accept_length:.3f} measured before export; nothing was written to {output_dir}."
        )


def resolve_source(source: Path, recipe_path: Path | None) -> DrafterSource:
    """A run directory, a checkpoint folder, its drafter/ folder, or a lone drafter folder (needs recipe_path)."""
    if not source.is_dir():
        raise ExportError(
            f"{source} is not a directory; pass a run directory, a checkpoint folder or a drafter folder."
        )
    if (source / "checkpoints").is_dir():
        try:
            checkpoint = latest_checkpoint(source)
        except CheckpointError as error:
            raise ExportError(str(error)) from None
        return replace(_checkpoint_source(checkpoint.directory, recipe_path), warning=checkpoint.warning)
    if (source / STATE_FILE).is_file():
        return _checkpoint_source(source, recipe_path)
    if (source / CONFIG_FILE).is_file() and (source.parent / STATE_FILE).is_file():
        return _checkpoint_source(source.parent, recipe_path)
    if (source / CONFIG_FILE).is_file():
        if recipe_path is None:
            raise ExportError(
                f"{source} is a drafter folder outside a run; pass --recipe RECIPE to name its target model and task."
            )
        return DrafterSource(source, _recipe(recipe_path), rl_step=None, checkpoint_dir=None)
    raise ExportError(f"{source} holds no drafter ({CONFIG_FILE}), checkpoint ({STATE_FILE}) or checkpoints/ folder.")


def _checkpoint_source(checkpoint_dir: Path, recipe_path: Path | None) -> DrafterSource:
    drafter_dir = checkpoint_dir / DRAFTER_DIRECTORY
    if not (drafter_dir / CONFIG_FILE).is_file():
        raise ExportError(
            f"checkpoint {checkpoint_dir} has no drafter/ folder: the run trained no drafter "
            "(enable a plugin that trains the drafter in plugins.enabled)."
        )
    run_recipe = checkpoint_dir.parent.parent / "recipe.yaml"
    try:
        state = checked_state(checkpoint_dir)
    except CheckpointError as error:
        raise ExportError(str(error)) from None
    return DrafterSource(
        drafter_dir, _recipe(recipe_path or run_recipe), rl_step=state["next_step"] - 1, checkpoint_dir=checkpoint_dir
    )


def _recipe(path: Path) -> Recipe:
    try:
        return load_checked_recipe(path)
    except UserError as error:
        raise ExportError(str(error)) from None


def load_target(source: DrafterSource) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The recipe's model, with the checkpoint's actor weights when the source is a run checkpoint."""
    if source.checkpoint_dir is None:
        return setup.policy_and_tokenizer(source.recipe)
    try:
        return policy_at_checkpoint(source.recipe, source.checkpoint_dir, advice="pass --recipe with the run's model")
    except CheckpointError as error:
        raise ExportError(str(error)) from None


def loading_sentence(source: DrafterSource) -> str:
    """The line before the target and the drafter load: which model, with which checkpoint's weights, which drafter."""
    weights = "" if source.checkpoint_dir is None else f" with the actor weights of {source.checkpoint_dir}"
    return f"loading the target {source.recipe.model.path}{weights} and the drafter in {source.drafter_dir}"


def held_out_probe(
    recipe: Recipe, tokenizer: PreTrainedTokenizerBase, prompts: int, max_new_tokens: int | None, draft_steps: int
) -> HeldOutProbe:
    """`prompts` problems of the recipe's task that the run never drew (indexes after its last step's)."""
    if not 1 <= prompts <= MAX_PROBE_PROMPTS or not 1 <= draft_steps <= MAX_DRAFT_STEPS:
        raise ExportError(
            f"--prompts must be in 1..{MAX_PROBE_PROMPTS} and --draft-steps in 1..{MAX_DRAFT_STEPS} to measure "
            f"acceptance, got {prompts} and {draft_steps}."
        )
    if max_new_tokens is not None and max_new_tokens < 1:
        raise ExportError(
            f"--max-new-tokens must be at least 1 (leave it out for the recipe's rollout.max_new_tokens "
            f"{recipe.rollout.max_new_tokens}), got {max_new_tokens}."
        )
    first_index = recipe.train.steps * recipe.train.prompts_per_step
    return HeldOutProbe(
        prompt_ids=encode_prompts(tokenizer, setup.task(recipe), range(first_index, first_index + prompts)),
        first_problem_index=first_index,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        max_new_tokens=max_new_tokens if max_new_tokens is not None else recipe.rollout.max_new_tokens,
        draft_steps=draft_steps,
    )


def measure_accept_length(target: PreTrainedModel, drafter: torch.nn.Module, probe: HeldOutProbe) -> AcceptMeasurement:
    """Greedy chain SD of `draft_steps` tokens, each prompt alone (batch size 1, where SD is on in the tail)."""
    decoder = SpeculativeDecoder(drafter, SpeculativeConfig(steps=probe.draft_steps))
    engine = EmbeddedEngine(
        target, eos_token_id=probe.eos_token_id, pad_token_id=probe.pad_token_id, speculative=decoder
    )
    sampling = SamplingParams(max_new_tokens=probe.max_new_tokens, temperature=0.0)
    passes, accepted = 0, 0
    accepted_by_depth, proposed_by_depth = [0] * probe.draft_steps, [0] * probe.draft_steps
    for index, prompt in enumerate(probe.prompt_ids):
        stats = engine.generate([RolloutRequest(index, tuple(prompt))], sampling, torch.Generator().manual_seed(0))[
            0
        ].speculative
        passes, accepted = passes + stats.verify_passes, accepted + stats.accepted_draft_tokens
        for depth, (accepted_count, proposed_count) in enumerate(zip(stats.accepted_by_depth, stats.proposed_by_depth)):
            accepted_by_depth[depth] += accepted_count
            proposed_by_depth[depth] += proposed_count
    return AcceptMeasurement(
        accept_length=accept_length(accepted, passes),
        verify_passes=passes,
        accepted_draft_tokens=accepted,
        accepted_by_depth=accepted_by_depth,
        proposed_by_depth=proposed_by_depth,
        prompts=len(probe.prompt_ids),
        first_problem_index=probe.first_problem_index,
        draft_steps=probe.draft_steps,
        max_new_tokens=probe.max_new_tokens,
    )


def _check_output(output_dir: Path, force: bool, source: Path) -> Path:
    """The folder to write the export as: `output_dir`, or the folder it links to. Refuses an output that is the
    source or holds it, a link (output or a folder above it) whose target is missing, and (with force) anything but
    a previous export.

    Trade-off: --force replaces only a folder recognised as an export (tlt_export.json and nothing but
    export files), so re-exporting into a folder the user added files to needs them moved first; in
    exchange a mistyped OUTPUT (a run directory, its parent, a home folder) is never deleted.
    An output that is a symbolic link (`drafters/latest -> v3`) is written through, as cp and rsync
    write through a linked destination: the link stays and keeps naming the export, and whatever
    else names v3 sees the new one; replacing the link by a folder would quietly split the two.
    """
    for path in (output_dir, *output_dir.parents):
        if path.is_symlink() and not path.exists():
            raise ExportError(
                f"{path} is a symbolic link to {path.parent / os.readlink(path)}, which does not exist; create that "
                "folder, or choose another output folder."
            )
    resolved, source_resolved = output_dir.resolve(), source.resolve()
    folder = resolved if output_dir.is_symlink() else output_dir
    if resolved == source_resolved or resolved in source_resolved.parents:
        raise ExportError(
            f"{output_dir} is the drafter source {source} or a folder holding it; choose an output folder outside it."
        )
    if output_dir.exists() and not output_dir.is_dir():
        raise ExportError(f"{output_dir} exists and is not a directory; choose another output folder.")
    if not output_dir.is_dir() or not any(output_dir.iterdir()):
        return folder
    if not force:
        raise ExportError(f"{output_dir} is not empty; pass --force to replace it, or choose another output folder.")
    if not is_previous_export(output_dir):
        raise ExportError(
            f"{output_dir} is not a previous export (it holds files other than {', '.join(sorted(EXPORT_FILES))}), "
            "so --force does not replace it; choose another output folder."
        )
    return folder


def is_previous_export(folder: Path) -> bool:
    """Whether `folder` holds an export of `tlt export-drafter`: its summary, and no file an export does not write."""
    names = {path.name for path in folder.iterdir()}
    return SUMMARY_FILE in names and names <= EXPORT_FILES and all((folder / name).is_file() for name in names)


def _replace_directory(staging: Path, output_dir: Path) -> None:
    """Rename staging to output_dir; an existing output_dir is moved aside first and removed after."""
    if not output_dir.exists():
        os.replace(staging, output_dir)
        return
    previous = output_dir.with_name(f".{output_dir.name}.previous-{os.getpid()}")
    os.replace(output_dir, previous)
    os.replace(staging, output_dir)
    shutil.rmtree(previous, ignore_errors=True)


def target_description(source: DrafterSource, target: PreTrainedModel) -> str:
    """The target as the model card names it: the recipe's model, at the checkpoint's RL step if any."""
    folder = str(target.name_or_path or source.recipe.model.path)
    if source.rl_step is None:
        return folder
    return (
        f"{source.recipe.model.path} after RL step {source.rl_step} "
        f"(actor weights in {source.checkpoint_dir / CHECKPOINT_TAG})"
    )


def shared_weights_line(include_shared: bool, drafter_config: PretrainedConfig) -> str:
    """The model card's word on the embedding and lm_head: in the folder, or left to SGLang's sharing."""
    if not include_shared:
        return (
            "not included: SGLang shares the target's embedding and lm_head with the draft "
            "(eagle_worker_v2.init_lm_head)"
        )
    names = "embed_tokens.weight" if drafter_config.tie_word_embeddings else "embed_tokens.weight, lm_head.weight"
    return (
        f"included ({names}) for loaders without the target at hand; "
        f"SGLang {SGLANG_VERSIONS_CHECKED} binds the target's own"
    )


def depth_table_rows(measurement: AcceptMeasurement) -> str:
    """The model card's rows of acceptance per draft depth: drafted, accepted, rate."""
    return "\n".join(
        f"| {depth + 1} | {proposed} | {accepted} | {accepted / proposed if proposed else 0.0:.2f} |"
        for depth, (proposed, accepted) in enumerate(zip(measurement.proposed_by_depth, measurement.accepted_by_depth))
    )


def measured_on_line(measurement: AcceptMeasurement, task_name: str) -> str:
    """What the model card's accept length was measured on."""
    last_problem = measurement.first_problem_index + measurement.prompts - 1
    return (
        f"{measurement.prompts} held-out prompts of task `{task_name}` "
        f"(problems {measurement.first_problem_index}-{last_problem}, after every problem the run drew), "
        f"greedy, chain of {measurement.draft_steps} draft tokens, batch size 1, at most "
        f"{measurement.max_new_tokens} new tokens, in tlt's embedded engine"
    )


def model_card(summary: ExportSummary, source: DrafterSource, drafter_config: PretrainedConfig) -> str:
    """README.md of the export: what it is, how well it drafts, how to serve it, and what differs under SGLang."""
    measurement = summary.measurement
    steps = measurement.draft_steps
    served_target = summary.target if source.rl_step is None else f"policy-step-{source.rl_step}"
    export_target = (
        ""
        if source.checkpoint_dir is None
        else f"tlt export-policy {source.checkpoint_dir.parent.parent} {served_target} --step {source.rl_step}\n"
    )
    shared = shared_weights_line(summary.include_shared, drafter_config)
    architecture = (
        f"`{summary.architecture}`: 1 decoder layer, hidden {drafter_config.hidden_size}, "
        f"vocabulary {drafter_config.vocab_size}"
    )
    depth_rows = depth_table_rows(measurement)
    measured_on = measured_on_line(measurement, source.recipe.task.name)
    token_map = (
        f" \\\n    --speculative-token-map {Path(summary.output_dir) / TOKEN_MAP_FILE}"
        if TOKEN_MAP_FILE in summary.files
        else ""
    )
    token_map_file = (
        f", `{TOKEN_MAP_FILE}` (the draft vocabulary's target ids, for `--speculative-token-map`)" if token_map else ""
    )
    layout_sources = "`models/llama_eagle.py`, `models/qwen2_eagle.py`, `speculative/eagle_worker_v2.py`"
    return f"""# EAGLE drafter for {summary.target}

Exported by `tlt export-drafter` from `{source.drafter_dir}`: a one-layer EAGLE drafter trained by
tlt during GRPO, on the target's own hidden states.

| | |
|---|---|
| target | {summary.target} |
| RL step | {source.rl_step if source.rl_step is not None else "none (drafter folder outside a run)"} |
| architecture | {architecture} |
| accept length | **{measurement.accept_length:.3f}** tokens per verify pass ({measurement.verify_passes} passes) |
| measured on | {measured_on} |
| reload check | this folder reloaded into tlt reproduces accept length {summary.reloaded_accept_length:.3f} |
| embedding / lm_head | {shared} |
| layout checked against | SGLang {SGLANG_VERSIONS_CHECKED} source: {layout_sources} |

## Serve with SGLang

```bash
{export_target}python -m sglang.launch_server --model-path {served_target} \\
    --speculative-algorithm EAGLE --speculative-draft-model-path {summary.output_dir} \\
    --speculative-num-steps {steps} --speculative-eagle-topk 1 --speculative-num-draft-tokens {steps + 1}{token_map}
```

`tlt export-policy` writes the target (the policy at the drafter's RL step) as a Hugging Face folder.
The drafter belongs to the target named above: with another target (or the same model at
another RL step) SD stays lossless but acceptance falls.

## Known differences under SGLang

- **Final norm.** tlt's drafter applies the target's final RMSNorm before `lm_head`; SGLang's
  EAGLE draft model applies none. The same weights therefore draft differently under SGLang,
  and its accept length can be lower than the {measurement.accept_length:.3f} measured here. Output
  stays lossless (the target verifies every token).
- **fc bias.** SGLang's `fc` is `Linear(2H, H)` with a bias; tlt's has none, so `fc.bias` is
  exported as zeros, which is exact.

## Acceptance per draft depth

| depth | drafted | accepted | rate |
|---|---|---|---|
{depth_rows}

## Files

`config.json` (the target's config with one layer and `architectures: [{summary.architecture}]`),
`model.safetensors` (`fc.weight`, `fc.bias`, `layers.0.*`{", shared weights" if summary.include_shared else ""}),
`tlt_export.json` (the measurement above, machine-readable){token_map_file}.
"""
