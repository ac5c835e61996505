"""A drafter folder the user names loads onto tlt's drafter (training/drafter_folder.py): tlt's own layout and
the EAGLE folder `tlt export-drafter` writes, each reproducing the drafter's outputs; an EAGLE-3 drafter, a biased
fc, pytorch_model.bin weights or a folder of neither layout are refused in one sentence."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from test_drafter import random_inputs, tiny_llama_untied
from tiny_models import tiny_llama

from tlt_cli.drafter.model import EagleDrafter, save_drafter
from tlt_cli.drafter.vocabulary import DraftVocabulary
from tlt_cli.errors import UserError
from tlt_cli.sglang.drafter_format import TOKEN_MAP_FILE, save_token_map, write_drafter_folder
from tlt_cli.training.drafter_folder import load_named_drafter

torch.set_num_threads(1)


def tiny_target():
    return tiny_llama(48, 0, 128, hidden_size=32, num_key_value_heads=4, tie_word_embeddings=True)


def trained_looking_drafter(target, reduced: bool) -> EagleDrafter:
    """A drafter with weights unlike a fresh one's (seeded noise), over a reduced vocabulary or the whole one."""
    vocabulary = DraftVocabulary(torch.arange(0, 48, 2), 48) if reduced else None
    drafter = EagleDrafter(target, seed=5, vocabulary=vocabulary)
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return drafter


def outputs(drafter: EagleDrafter):
    input_ids, _, position_ids = random_inputs(length=7)
    target_hidden = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        return drafter(input_ids, target_hidden, position_ids, None, None)


@pytest.mark.parametrize("reduced", [False, True])
def test_an_exported_eagle_folder_loads_as_the_drafter_it_was(tmp_path, reduced):
    target = tiny_target()
    drafter = trained_looking_drafter(target, reduced)
    write_drafter_folder(drafter, target, tmp_path)
    if reduced:
        save_token_map(drafter.vocabulary, tmp_path / TOKEN_MAP_FILE)
    loaded = load_named_drafter(tmp_path, target)
    torch.testing.assert_close(outputs(loaded).logits, outputs(drafter).logits)
    assert loaded.vocabulary.size == drafter.vocabulary.size


def test_tlts_own_layout_loads(tmp_path):
    target = tiny_target()
    drafter = trained_looking_drafter(target, reduced=True)
    save_drafter(drafter, tmp_path)
    torch.testing.assert_close(outputs(load_named_drafter(tmp_path, target)).hidden, outputs(drafter).hidden)


def write_eagle_folder(folder, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))


def test_an_eagle3_drafter_is_refused_naming_why(tmp_path):
    target = tiny_target()
    write_eagle_folder(
        tmp_path / "by-name", {"architectures": ["LlamaForCausalLMEagle3"]}, {"fc.weight": torch.ones(1)}
    )
    write_eagle_folder(tmp_path / "by-tensors", {"architectures": ["LlamaForCausalLM"]}, {"midlayer.x": torch.ones(1)})
    for folder in ("by-name", "by-tensors"):
        with pytest.raises(UserError, match="is an EAGLE-3 drafter: it reads three of the target's layers"):
            load_named_drafter(tmp_path / folder, target)


def test_an_eagle_fc_with_a_bias_is_refused(tmp_path):
    target = tiny_target()
    write_drafter_folder(trained_looking_drafter(target, reduced=False), target, tmp_path)
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["fc.bias"] = torch.ones(32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(UserError, match="fc.bias is not zero"):
        load_named_drafter(tmp_path, target)


def test_another_targets_export_is_refused(tmp_path):
    write_drafter_folder(trained_looking_drafter(tiny_llama_untied(), reduced=False), tiny_llama_untied(), tmp_path)
    wider = tiny_llama(48, 0, 128, hidden_size=64, num_key_value_heads=4, tie_word_embeddings=True)
    with pytest.raises(UserError, match="not a LlamaForCausalLMEagle drafter for this target"):
        load_named_drafter(tmp_path, wider)


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ("empty", "holds no drafter: tlt loads a folder tlt saved"),
        ("bin weights", "has only pytorch_model.bin, not model.safetensors"),
        ("config not JSON", "is not a JSON config"),
        ("config a list", "is a JSON list, not a model config"),
        ("weights not safetensors", "cannot be read as safetensors"),
    ],
)
def test_a_folder_of_neither_layout_is_one_sentence(tmp_path, layout, message):
    if layout != "empty":
        (tmp_path / "config.json").write_text("[1]" if layout == "config a list" else "{}")
    if layout == "bin weights":
        torch.save({"fc.weight": torch.ones(1)}, tmp_path / "pytorch_model.bin")
    if layout == "config not JSON":
        (tmp_path / "config.json").write_text("{not json")
    if layout == "weights not safetensors":
        (tmp_path / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(UserError, match=message) as refused:
        load_named_drafter(tmp_path, tiny_target())
    assert "\n" not in str(refused.value)


def test_drafter_init_names_an_exported_folder_and_the_run_starts_from_it(tmp_path):
    from tlt_cli.config.loading import load_recipe
    from tlt_cli.recipes import resolve_recipe_path
    from tlt_cli.training import setup

    target = tiny_target()
    drafter = trained_looking_drafter(target, reduced=True)
    write_drafter_folder(drafter, target, tmp_path)
    save_token_map(drafter.vocabulary, tmp_path / TOKEN_MAP_FILE)
    recipe = load_recipe(resolve_recipe_path("tiny-cpu"), [f"drafter.init={tmp_path}"])
    folder, report = setup.prepare_drafter(recipe, tmp_path / "cache")
    assert folder == tmp_path and report is None
    started = setup.starting_drafter(recipe, folder, target)
    torch.testing.assert_close(outputs(started).logits, outputs(drafter).logits)
