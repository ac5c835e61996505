"""`tlt export-drafter`: SGLang's EAGLE layout, a reload that reproduces the acceptance, sources, refusals."""

import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from tlt_cli.checkpoint import prepare_staging, publish
from tlt_cli.cli import app
from tlt_cli.config import ActorConfig
from tlt_cli.drafter.model import EagleDrafter, save_drafter
from tlt_cli.export import (
    ExportError,
    export_drafter,
    held_out_probe,
    load_target,
    measure_accept_length,
    resolve_source,
)
from tlt_cli.models.tiny import build_tiny_model, save_model_folder, tiny_model_config, tiny_tokenizer
from tlt_cli.sglang.drafter_format import DrafterFormatError, load_exported_drafter
from tlt_cli.training.actor import Actor

torch.set_num_threads(1)
runner = CliRunner()


def tiny_target(architecture="qwen2"):
    tokenizer = tiny_tokenizer()
    config = tiny_model_config(
        tokenizer,
        architecture=architecture,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=64,
        tie_word_embeddings=architecture == "qwen2",
    )
    return build_tiny_model(0, config).eval(), tokenizer


def partly_right_drafter(target, noise=0.1):
    """A drafter that proposes roughly the target's previous prediction, with noise: some drafts accepted, not all.

    fc passes target_hidden through, the layer's residual branches start at zero, then every weight is perturbed.
    """
    drafter = EagleDrafter(target, seed=1)
    hidden_size = target.config.hidden_size
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, hidden_size:] = torch.eye(hidden_size)
        drafter.decoder_layer.self_attn.o_proj.weight.zero_()
        drafter.decoder_layer.mlp.down_proj.weight.zero_()
        for parameter in drafter.parameters():
            parameter.add_(noise * torch.randn(parameter.shape, generator=generator))
    return drafter


def write_recipe(path, model_dir, steps=3):
    path.write_text(
        f"run: {{name: exported}}\nmodel: {{path: {model_dir}}}\n"
        f"train: {{steps: {steps}, prompts_per_step: 2, group_size: 2}}\n"
        "workers: {count: 1}\nrollout: {max_new_tokens: 40}\n"
    )
    return path


@pytest.fixture
def drafter_folder(tmp_path):
    """(drafter folder, recipe, target) for a tiny Qwen2 target saved as a model folder."""
    target, tokenizer = tiny_target()
    save_model_folder(target, tokenizer, tmp_path / "model")
    save_drafter(partly_right_drafter(target), tmp_path / "drafter")
    return tmp_path / "drafter", write_recipe(tmp_path / "recipe.yaml", tmp_path / "model"), target


def test_export_has_sglang_names_and_config_and_reloads_to_the_same_greedy_acceptance(tmp_path, drafter_folder):
    drafter_dir, recipe, _ = drafter_folder
    summary = export_drafter(drafter_dir, tmp_path / "out", recipe_path=recipe, prompts=4)
    out = tmp_path / "out"
    assert sorted(path.name for path in out.iterdir()) == [
        "README.md",
        "config.json",
        "model.safetensors",
        "tlt_export.json",
    ]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLMEagle"] and config["num_hidden_layers"] == 1
    tensors = load_file(str(out / "model.safetensors"))
    assert {
        "fc.weight",
        "fc.bias",
        "layers.0.self_attn.q_proj.weight",
        "layers.0.post_attention_layernorm.weight",
    } <= set(tensors)
    assert all(name in ("fc.weight", "fc.bias") or name.startswith("layers.0.") for name in tensors)
    assert not tensors["fc.bias"].any() and "layers.0.input_layernorm.weight" not in tensors

    # the reload is exact, and drafts exactly as the drafter that was exported
    target, tokenizer = load_target(resolve_source(drafter_dir, recipe))
    original = partly_right_drafter(target)
    reloaded = load_exported_drafter(out, target)
    for name, value in original.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], value), name
    probe = held_out_probe(resolve_source(drafter_dir, recipe).recipe, tokenizer, 4, None, 4)
    again = measure_accept_length(target, reloaded, probe)
    measured = summary.measurement
    assert (again.verify_passes, again.accepted_draft_tokens) == (
        measured.verify_passes,
        measured.accepted_draft_tokens,
    )
    assert 1.5 < measured.accept_length < 4.9  # some drafts accepted, not all: the check can see a wrong mapping
    assert summary.reloaded_accept_length == measured.accept_length
    assert measured.first_problem_index == 3 * 2  # after every problem of the recipe's 3 steps of 2 prompts

    card = (out / "README.md").read_text()
    for text in (
        f"{measured.accept_length:.3f}",
        "--speculative-algorithm EAGLE",
        f"--speculative-draft-model-path {out}",
        "Final norm",
        "fc.bias",
        "SGLang 0.5.23",
    ):
        assert text in card, text
    assert json.loads((out / "tlt_export.json").read_text())["measurement"]["verify_passes"] == measured.verify_passes


def test_a_wrong_drafter_for_the_target_does_not_reload(tmp_path, drafter_folder):
    drafter_dir, recipe, _ = drafter_folder
    export_drafter(drafter_dir, tmp_path / "out", recipe_path=recipe, prompts=1)
    llama, _ = tiny_target("llama")
    with pytest.raises(DrafterFormatError, match="not a LlamaForCausalLMEagle drafter"):
        load_exported_drafter(tmp_path / "out", llama)


def test_llama_export_names_its_class_and_can_include_the_untied_head(tmp_path):
    target, tokenizer = tiny_target("llama")
    save_model_folder(target, tokenizer, tmp_path / "model")
    save_drafter(partly_right_drafter(target, noise=0.0), tmp_path / "drafter")
    recipe = write_recipe(tmp_path / "recipe.yaml", tmp_path / "model")
    export_drafter(tmp_path / "drafter", tmp_path / "out", recipe_path=recipe, include_shared=True, prompts=2)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert config["architectures"] == ["LlamaForCausalLMEagle"] and config["tie_word_embeddings"] is False
    assert torch.equal(tensors["lm_head.weight"], target.lm_head.weight) and "embed_tokens.weight" in tensors
    reloaded_target, _ = load_target(resolve_source(tmp_path / "drafter", recipe))
    load_exported_drafter(tmp_path / "out", reloaded_target)  # shared weights checked against the target's own


def test_force_replaces_only_a_previous_export_atomically(tmp_path, drafter_folder):
    drafter_dir, recipe, _ = drafter_folder
    out = tmp_path / "out"
    export_drafter(drafter_dir, out, recipe_path=recipe, prompts=1)
    with pytest.raises(ExportError, match="is not empty; pass --force"):
        export_drafter(drafter_dir, out, recipe_path=recipe, prompts=1)
    (out / "model.safetensors").write_bytes(b"an older export")
    export_drafter(drafter_dir, out, recipe_path=recipe, prompts=1, force=True)
    assert load_file(str(out / "model.safetensors"))  # the new export replaced the old one
    assert [path.name for path in tmp_path.iterdir() if path.name.startswith(".")] == []

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="is not a previous export"):
        export_drafter(drafter_dir, mine, recipe_path=recipe, prompts=1, force=True)
    (out / "notes.txt").write_text("added by hand")
    with pytest.raises(ExportError, match="is not a previous export"):
        export_drafter(drafter_dir, out, recipe_path=recipe, prompts=1, force=True)
    assert (mine / "keep.txt").read_text() == "mine" and (out / "notes.txt").is_file()
    for holder in (drafter_dir, tmp_path):
        with pytest.raises(ExportError, match="or a folder holding it"):
            export_drafter(drafter_dir, holder, recipe_path=recipe, prompts=1, force=True)
    assert (drafter_dir / "drafter.safetensors").is_file()


def test_a_drafter_folder_outside_a_run_needs_a_recipe(tmp_path, drafter_folder):
    drafter_dir, _, _ = drafter_folder
    with pytest.raises(ExportError, match="pass --recipe"):
        export_drafter(drafter_dir, tmp_path / "out")
    with pytest.raises(ExportError, match="holds no drafter"):
        export_drafter(tmp_path / "model", tmp_path / "out")


def test_run_directory_exports_the_latest_checkpoint_against_the_actor_weights_of_that_step(
    single_process_group, tmp_path, drafter_folder
):
    _, _, base = drafter_folder
    run = tmp_path / "run"
    run.mkdir()
    write_recipe(run / "recipe.yaml", tmp_path / "model")
    policy = build_tiny_model(0, base.config)
    with torch.no_grad():
        policy.model.norm.weight.mul_(1.5)  # the policy after RL differs from the model folder
    staging = prepare_staging(run / "checkpoints", 3)
    Actor(policy, ActorConfig(precision="fp32", micro_batch_size=2), sequences_per_update=2).save(staging)
    save_drafter(partly_right_drafter(policy), staging / "drafter")
    publish(run / "checkpoints", 3, {"world_size": 1}, keep=2)

    source = resolve_source(run, None)
    target, _ = load_target(source)
    assert source.rl_step == 2 and torch.equal(target.model.norm.weight, policy.model.norm.weight)
    result = runner.invoke(app, ["export-drafter", str(run), str(tmp_path / "out"), "--prompts", "2"])
    assert result.exit_code == 0, result.output
    assert "accept length" in result.output and "reload reproduces" in result.output
    card = (tmp_path / "out" / "README.md").read_text()
    assert "after RL step 2" in card and "--model-path policy-step-2" in card

    again = runner.invoke(app, ["export-drafter", str(run), str(tmp_path / "out")])
    assert again.exit_code == 2 and "not empty" in again.output
    (run / "checkpoints" / "step_000003" / "drafter" / "drafter_config.json").unlink()
    missing = runner.invoke(app, ["export-drafter", str(run), str(tmp_path / "other")])
    assert missing.exit_code == 2 and "drafter_config.json is missing or truncated" in missing.output
