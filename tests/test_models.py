"""Models: the char tokenizer round-trip, the tiny model build/warm-up/cache, and load_policy."""

from __future__ import annotations

import random
import shutil
import time

import pytest
import safetensors.torch
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast, ViTConfig
from typer.testing import CliRunner

from tlt_cli.cli import app
from tlt_cli.config import load_recipe
from tlt_cli.drafter.initial import warmup_key
from tlt_cli.models.loading import ModelLoadError, load_policy, model_fingerprint, model_folder
from tlt_cli.models.tiny import (
    IGNORED_LABEL,
    SHIPPED_TINY_MODEL,
    _length_sorted_batches,
    _supervised_example,
    build_tiny_model,
    ensure_tiny_model,
    save_model_folder,
    slipped_solution,
    tiny_model_config,
    tiny_tokenizer,
    warm_up,
)
from tlt_cli.models.tokenizer import build_char_tokenizer
from tlt_cli.recipes import RECIPES_DIRECTORY
from tlt_cli.tasks.arithmetic import CHARACTERS, ArithmeticTask, make_problem

torch.set_num_threads(1)


def small_config(architecture: str = "qwen2", tie_word_embeddings: bool = True, vocab_size: int | None = None):
    config = tiny_model_config(
        architecture=architecture,
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
        max_position_embeddings=256,
        tie_word_embeddings=tie_word_embeddings,
    )
    if vocab_size is not None:
        config.vocab_size = vocab_size
    return config


def test_char_tokenizer_one_id_per_character_and_plain_decode():
    tokenizer = build_char_tokenizer("ab c\n")
    ids = tokenizer("a b\n\nca", add_special_tokens=True)["input_ids"]
    assert len(ids) == len("a b\n\nca")
    assert tokenizer.decode(ids) == "a b\n\nca"
    assert tokenizer.decode([*ids, tokenizer.eos_token_id], skip_special_tokens=True) == "a b\n\nca"
    assert tokenizer("z")["input_ids"] == [tokenizer.unk_token_id]
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)


def test_char_tokenizer_save_and_auto_load_round_trip(tmp_path):
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    text = make_problem(0, [3, 1, 4]).prompt + make_problem(0, [3, 1, 4]).solution
    assert reloaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert reloaded.decode(reloaded(text)["input_ids"]) == text
    assert reloaded.eos_token_id == tokenizer.eos_token_id
    assert len(reloaded) == len(CHARACTERS) + 4


def test_tiny_config_defaults_and_seeded_build():
    config = tiny_model_config()
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (256, 8, 4)
    assert (config.num_key_value_heads, config.intermediate_size, config.max_position_embeddings) == (2, 512, 1024)
    assert config.vocab_size == len(tiny_tokenizer()) and config.tie_word_embeddings
    first, again, other = (build_tiny_model(seed, small_config()) for seed in (0, 0, 1))
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), again.parameters()))
    assert not torch.equal(first.lm_head.weight, other.lm_head.weight)
    assert first.lm_head.weight is first.get_input_embeddings().weight


def test_supervised_example_masks_the_prompt():
    tokenizer = tiny_tokenizer()
    problem = make_problem(0, [3, 1])
    input_ids, labels = _supervised_example(tokenizer, problem.prompt, problem.solution)
    assert tokenizer.decode(input_ids, skip_special_tokens=True) == problem.prompt + problem.solution
    assert input_ids[-1] == tokenizer.eos_token_id
    assert labels[: len(problem.prompt)] == [IGNORED_LABEL] * len(problem.prompt)
    assert labels[len(problem.prompt) :] == input_ids[len(problem.prompt) :]


def test_slips_are_off_by_one_and_carry_into_later_totals_and_the_answer():
    problem = make_problem(0, [3, 9, 0, 9, 9, 1])
    assert slipped_solution(problem, 0.0, random.Random(0)) == problem.solution
    always = slipped_solution(problem, 1.0, random.Random(0))
    steps, _, answer = always.partition("#")
    totals = [int(step[3:]) for step in steps.split(",")]
    running_sum = 0
    for digit, total in zip([3, 9, 0, 9, 9, 1], totals):
        assert (
            abs(total - (running_sum + digit)) == 1 and 0 <= total <= 18
        )  # every step slipped, from its own running sum
        running_sum = total % 10
    assert answer == str(running_sum) and always != problem.solution
    generator = random.Random(1)
    solutions = [slipped_solution(problem, 0.1, generator) for _ in range(400)]
    slipped_steps = sum(solution.split("#")[0].split(",")[0] != "a3:03" for solution in solutions)
    assert 20 <= slipped_steps <= 65  # the first step slips about 40 times in 400


def test_warm_up_batches_are_length_sorted_so_padding_stays_small():
    tokenizer = tiny_tokenizer()
    batches = list(_length_sorted_batches(tokenizer, ArithmeticTask(seed=0), 64, 12, random.Random(0)))
    assert len(batches) == 64 and all(input_ids.shape[0] == 12 for input_ids, _, _ in batches)
    real_tokens = sum(int(attention_mask.sum()) for _, attention_mask, _ in batches)
    padded_tokens = sum(input_ids.numel() for input_ids, _, _ in batches)
    assert padded_tokens < 1.2 * real_tokens
    for input_ids, attention_mask, labels in batches:
        assert torch.all(labels[attention_mask == 0] == IGNORED_LABEL)
        assert torch.all(input_ids[attention_mask == 0] == tokenizer.pad_token_id)


def test_warm_up_lowers_the_solution_loss():
    tokenizer = tiny_tokenizer()
    model = build_tiny_model(0, small_config())
    losses = warm_up(model, tokenizer, ArithmeticTask(seed=0, max_terms=4), steps=60, batch_size=8, lr=1e-2, seed=0)
    assert len(losses) == 60
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5
    assert not model.training


def test_ensure_tiny_model_builds_once_atomically_and_loads(tmp_path):
    config = small_config()
    model_dir = ensure_tiny_model(tmp_path, seed=0, warmup_steps=2, config=config)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {path.name for path in model_dir.iterdir()}
    weights_mtime = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(tmp_path, seed=0, warmup_steps=2, config=config) == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == weights_mtime
    assert ensure_tiny_model(tmp_path, seed=1, warmup_steps=2, config=config) != model_dir
    assert not [path for path in tmp_path.iterdir() if path.name.startswith(".")]  # no staging folder left
    model, tokenizer = load_policy(str(model_dir))
    problem = ArithmeticTask(seed=0).problem(1)
    assert tokenizer(problem.solution)["input_ids"] == tiny_tokenizer()(problem.solution)["input_ids"]
    prompt_ids = tokenizer("a3b1=", return_tensors="pt")["input_ids"]
    generated = model.generate(prompt_ids, max_new_tokens=4, do_sample=False)
    assert prompt_ids.shape[1] < generated.shape[1] <= prompt_ids.shape[1] + 4


def test_fingerprint_and_drafter_warm_up_key_change_with_the_weights_not_the_path(tmp_path):
    model_dir = tmp_path / "model"
    save_model_folder(build_tiny_model(0, small_config()), tiny_tokenizer(), model_dir)
    recipe = load_recipe(RECIPES_DIRECTORY / "tiny-cpu.yaml", [f"model.path={model_dir}"])
    fingerprint, key = model_fingerprint(str(model_dir)), warmup_key(recipe, tmp_path)
    assert model_fingerprint(str(model_dir)) == fingerprint and warmup_key(recipe, tmp_path) == key
    time.sleep(0.01)  # a distinct modification time even on coarse clocks
    save_model_folder(build_tiny_model(1, small_config()), tiny_tokenizer(), model_dir.with_name("retrained"))
    shutil.rmtree(model_dir)
    model_dir.with_name("retrained").rename(model_dir)
    assert model_fingerprint(str(model_dir)) != fingerprint and warmup_key(recipe, tmp_path) != key


def test_load_policy_llama_untied_large_vocab(tmp_path):
    config = small_config("llama", tie_word_embeddings=False, vocab_size=32000)
    saved = build_tiny_model(3, config)
    saved.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    model, tokenizer = load_policy(str(tmp_path))
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.lm_head.weight.shape == (32000, 32)
    assert model.lm_head.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()
    assert torch.equal(model.lm_head.weight, saved.lm_head.weight)
    assert model.get_decoder() is model.model
    assert tokenizer.pad_token_id is not None


def save_tiny_folder(folder, tokenizer=None, architecture="qwen2"):
    build_tiny_model(0, small_config(architecture)).save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder


def test_load_policy_errors_name_the_problem(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_policy(str(tmp_path / "absent"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_policy(str(tmp_path / "empty"))
    ViTConfig().save_pretrained(tmp_path / "vision")
    with pytest.raises(ModelLoadError, match="'vit', which is not a causal language model"):
        load_policy(str(tmp_path / "vision"))
    with pytest.raises(ModelLoadError, match="has no tokenizer"):
        load_policy(str(save_tiny_folder(tmp_path / "no_tokenizer")))
    with pytest.raises(ModelLoadError, match="has no EOS token"):
        load_policy(str(save_tiny_folder(tmp_path / "no_eos", tokenizer_without_eos(), "llama")))


def test_load_policy_sets_pad_to_eos_when_missing(tmp_path):
    tokenizer = tiny_tokenizer()
    tokenizer.pad_token = None
    _, loaded = load_policy(str(save_tiny_folder(tmp_path, tokenizer)))
    assert loaded.pad_token_id == loaded.eos_token_id == tokenizer.eos_token_id


def tokenizer_without_eos():
    backend = Tokenizer(models.WordLevel(vocab={"<unk>": 0, "a": 1}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


def test_builtin_tiny_model_is_the_shipped_folder_small_and_half_solves_the_task():
    folder = model_folder("builtin:tiny-arith")
    assert folder == SHIPPED_TINY_MODEL and sum(path.stat().st_size for path in folder.iterdir()) < 20 * 2**20
    model, tokenizer = load_policy("builtin:tiny-arith")
    shape = (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "tie_word_embeddings",
        "eos_token_id",
        "pad_token_id",
    )
    assert [getattr(model.config, name) for name in shape] == [getattr(tiny_model_config(), name) for name in shape]
    assert next(model.parameters()).dtype == torch.float32  # stored in bfloat16, loaded as tlt trains it
    task = ArithmeticTask(seed=99)
    problems = [problem for problem in (task.problem(index) for index in range(64)) if len(problem.prompt) <= 7][:16]
    tokenizer.padding_side = "left"
    batch = tokenizer([problem.prompt for problem in problems], return_tensors="pt", padding=True)
    generated = model.generate(**batch, max_new_tokens=24, do_sample=False)
    responses = tokenizer.batch_decode(generated[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    # greedy, the warmed-up model solves short problems (its slips are the less likely tokens)
    assert sum(task.reward(problem, response) == 1.0 for problem, response in zip(problems, responses)) >= 12


def stripped_folder(folder, drop=(), add=(), weights_format="safetensors"):
    """A tiny model folder whose weights lack the tensors named in `drop` and hold extra ones named in `add`."""
    save_tiny_folder(folder, tiny_tokenizer())
    weights = safetensors.torch.load_file(folder / "model.safetensors")
    for name in drop:
        del weights[name]
    for name in add:
        weights[name] = torch.zeros(2)
    (folder / "model.safetensors").unlink()
    if weights_format == "safetensors":
        safetensors.torch.save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    else:
        torch.save(weights, folder / "pytorch_model.bin")
    return folder


LAYER_TENSORS = ("model.layers.1.mlp.down_proj.weight", "model.layers.1.self_attn.q_proj.weight")


@pytest.mark.parametrize("weights_format", ["safetensors", "bin"])
def test_a_weight_file_missing_a_layer_or_holding_a_stray_tensor_is_refused_in_one_sentence(tmp_path, weights_format):
    """transformers would start the missing layer random (its load report only warns); tlt refuses, by the
    safetensors headers before anything loads (validate) and by the load's own report (.bin has no header)."""
    missing = stripped_folder(tmp_path / "missing", drop=LAYER_TENSORS, weights_format=weights_format)
    with pytest.raises(ModelLoadError, match=r"lack model\.layers\.1\.\S+ and 1 more, which the model"):
        load_policy(str(missing))
    stray = stripped_folder(tmp_path / "stray", add=("model.layers.9.extra.weight",), weights_format=weights_format)
    with pytest.raises(ModelLoadError, match=r"hold model\.layers\.9\.extra\.weight, which the model .* no place"):
        load_policy(str(stray))


def test_validate_refuses_a_model_folder_missing_a_layer_in_one_line(tmp_path):
    folder = stripped_folder(tmp_path / "model", drop=LAYER_TENSORS[:1])
    result = CliRunner().invoke(
        app, ["recipes", "validate", "tiny-cpu", f"model.path={folder}", "drafter.init=random", "plugins.enabled=[]"]
    )
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [
        f"invalid model.path: Model weights in {folder} lack {LAYER_TENSORS[0]}, which the model its config.json "
        "builds has (training would start those layers random); the weight files are incomplete, save the model again."
    ]


def test_a_tied_lm_head_saved_once_is_not_missing(tmp_path):
    """save_pretrained writes a tied embedding once (no lm_head.weight): that folder is whole."""
    folder = save_tiny_folder(tmp_path / "tied", tiny_tokenizer())
    assert "lm_head.weight" not in safetensors.torch.load_file(folder / "model.safetensors")
    model, _ = load_policy(str(folder))
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
