"""tlt's rollout under TRL's real GRPOTrainer (rollout_func), on tiny models the tests build.

The contract: TRL trains every parameter on exactly the completions tlt generated, with the
log-probs tlt returned equal to the policy's own; chat templates applied as TRL applies them;
greedy completions token-identical with and without speculative decoding; an unsupported TRL
refused in one sentence naming the range; examples/trl_grpo.py under two data-parallel processes,
the drafter sidecar training in their wait and the copies averaged.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from tlt_cli.config import RecipeError
from tlt_cli.integrations import trl_support
from tlt_cli.integrations.trl import tlt_rollout
from tlt_cli.integrations.trl_support import UnsupportedTrlError, UnsupportedTrlSettingError
from tlt_cli.models.tiny import build_tiny_model, tiny_model_config, tiny_tokenizer
from tlt_cli.speculative.adaptive import SpeculationMode
from tlt_cli.versions import supported_ranges

os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "trl_grpo.py"
# a chat template of the arithmetic vocabulary's own characters: TRL's conversational path renders it
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"
)


def tiny_policy(seed: int = 0):
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    config = tiny_model_config(
        tokenizer, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64
    )
    return build_tiny_model(seed, config), tokenizer


def grpo_trainer(model, tokenizer, rollout, reward, prompts, tmp_path, **settings):
    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=12,
        max_steps=2,
        learning_rate=1e-2,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        bf16=False,
        logging_steps=1,
        disable_tqdm=True,
        **settings,
    )
    dataset = Dataset.from_dict({"prompt": prompts})
    return GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        rollout_func=rollout,
    )


def test_grpo_trainer_trains_every_parameter_on_the_completions_and_logprobs_tlt_generated(tmp_path, monkeypatch):
    monkeypatch.setenv("TLT_CACHE_DIR", str(tmp_path / "cache"))
    model, tokenizer = tiny_policy()
    before = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    rollout = tlt_rollout(drafter="random", seed=0, dtype="float32")
    returned, scored, policy_logprobs = [], [], []

    def recorded_rollout(prompts, trainer):
        returned.append(rollout(prompts, trainer))
        return returned[-1]

    def reward(prompts, completions, completion_ids, **_):
        # the reward runs after the rollout and before the optimizer step: the policy is the one that generated
        scored.append(completion_ids)
        policy_logprobs.append(logprobs_under(model, returned[-1]["prompt_ids"], completion_ids, temperature=1.0))
        return [float(sum(ids) % 7) for ids in completion_ids]  # differs within groups, so every advantage is not 0

    messages = [[{"role": "user", "content": text}] for text in ("a1b2", "a3b4", "a5b6", "a7b8")]
    trainer = grpo_trainer(model, tokenizer, recorded_rollout, reward, messages * 2, tmp_path)
    trainer.train()

    assert [name for name, parameter in model.named_parameters() if torch.equal(parameter, before[name])] == []
    assert len(scored) == len(returned) == 2
    for output, completion_ids, reference in zip(returned, scored, policy_logprobs):
        assert completion_ids == output["completion_ids"]
        for prompt_ids in output["prompt_ids"]:
            rendered = [
                tokenizer.apply_chat_template(
                    conversation, add_generation_prompt=True, tokenize=True, return_dict=True
                )["input_ids"]
                for conversation in messages
            ]
            assert prompt_ids in rendered
        for logprobs, expected in zip(output["logprobs"], reference):
            assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-4)
    records = rollout.take_records()
    assert [record.global_step for record in records] == [0, 1]
    assert all(len(record.requests) == 4 and record.sd_usage and record.accept_length >= 1.0 for record in records)


def logprobs_under(model, prompt_ids, completion_ids, temperature):
    """Each completion token's log-probability under `model`, from one full forward (TRL's formula)."""
    values = []
    with torch.no_grad():
        for prompt, completion in zip(prompt_ids, completion_ids):
            logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].float() / temperature
            values.append(logits.log_softmax(-1).gather(1, torch.tensor(completion)[:, None]).squeeze(1))
    return values


def test_greedy_completions_are_token_identical_with_and_without_speculative_decoding(tmp_path, monkeypatch):
    monkeypatch.setenv("TLT_CACHE_DIR", str(tmp_path / "cache"))
    model, tokenizer = tiny_policy(seed=1)
    prompts = ["a1b2=", "a3b4c5=", "a6=", "a7b8c9d1="]
    small_warmup = {"warmup_prompts": 4, "warmup_steps": 3, "warmup_batch_size": 4}
    outputs = {}
    for name, speculative in (("off", {"mode": "off"}), ("fixed", {"mode": "fixed", "steps": 3}), ("adaptive", None)):
        rollout = tlt_rollout(speculative=speculative, drafter="warmup", drafter_config=small_warmup, dtype="float32")
        trainer = grpo_trainer(
            model,
            tokenizer,
            rollout,
            lambda completions, **_: [0.0] * len(completions),
            prompts,
            tmp_path,
            generation_kwargs={"do_sample": False},
        )
        outputs[name] = rollout(prompts, trainer)["completion_ids"]
        verify_passes = sum(request.verify_passes for request in rollout.take_records()[0].requests)
        assert (verify_passes > 0) == (name != "off")
    assert outputs["fixed"] == outputs["off"] and outputs["adaptive"] == outputs["off"]
    assert any(len(completion) > 3 for completion in outputs["off"])


def test_a_checkpoint_carries_the_drafter_schedule_and_rollout_count_into_a_new_rollout(tmp_path):
    model, tokenizer = tiny_policy()
    rollout = tlt_rollout(drafter="random", seed=0, dtype="float32")
    trainer = grpo_trainer(
        model, tokenizer, rollout, lambda completions, **_: [0.0] * len(completions), ["a1="], tmp_path
    )
    for _ in range(2):
        rollout(["a1b2=", "a1b2=", "a3=", "a3="], trainer)
    rollout.save_state(tmp_path / "checkpoint", process=0)
    assert (tmp_path / "checkpoint" / "drafter" / "drafter_config.json").is_file()  # what tlt export-drafter reads

    resumed = tlt_rollout(
        drafter="random", seed=7, dtype="float32"
    )  # another start, replaced by the checkpoint's drafter
    resumed.load_state(tmp_path / "checkpoint", process=0)
    resumed(["a1b2=", "a1b2="], trainer)
    assert resumed.rollouts == 3
    saved, restored = rollout.drafter.state_dict(), resumed.drafter.state_dict()
    assert all(torch.equal(saved[name], restored[name]) for name in saved)
    assert resumed.backend.schedule.states[0].measured_steps >= rollout.backend.schedule.states[0].measured_steps


def test_an_unsupported_trl_version_is_refused_in_one_sentence_naming_the_range(monkeypatch):
    with pytest.raises(UnsupportedTrlError) as refused:
        trl_support.check_trl_version("1.15.2")
    message = str(refused.value)
    assert f"trl{supported_ranges()['trl']} " in message and message.count(". ") == 0 and message.endswith(".")
    monkeypatch.setattr(trl_support, "installed_trl_version", lambda: "1.17.0")
    with pytest.raises(UnsupportedTrlError, match="TRL 1.17.0 is not supported"):
        tlt_rollout()
    monkeypatch.setattr(trl_support, "installed_trl_version", lambda: None)
    with pytest.raises(UnsupportedTrlError, match="TRL is not installed"):
        tlt_rollout()


def test_settings_the_engine_cannot_honour_are_refused_in_one_sentence(tmp_path):
    model, tokenizer = tiny_policy()
    rollout = tlt_rollout(drafter="random", dtype="float32")
    trainer = grpo_trainer(
        model,
        tokenizer,
        rollout,
        lambda completions, **_: [0.0] * len(completions),
        ["a1="],
        tmp_path,
        repetition_penalty=1.2,
    )
    with pytest.raises(UnsupportedTrlSettingError, match="repetition_penalty=1.2"):
        rollout(["a1=", "a1="], trainer)
    with pytest.raises(ValueError, match="speculative has no key 'depth'"):
        tlt_rollout(speculative={"depth": 3})
    with pytest.raises(
        RecipeError, match="^speculative mode must be one of off, fixed, adaptive, auto, got 'sometimes'.$"
    ):
        tlt_rollout(speculative={"mode": "sometimes"})
    assert tlt_rollout(speculative={"mode": "off"}).speculative.mode is SpeculationMode.off


def test_the_example_trains_with_two_processes_and_the_drafter_learns_in_their_wait(tmp_path):
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(EXAMPLE),
        "--steps",
        "3",
        "--batch-size",
        "8",
        "--num-generations",
        "4",
        "--max-completion-length",
        "48",
        "--drafter",
        "random",
        "--output-dir",
        str(tmp_path / "run"),
    ]
    # torch.distributed.run leaves a torchelastic_* folder in the system temporary folder: make it the test's own
    (tmp_path / "tmp").mkdir()
    environment = {
        **os.environ,
        "TLT_CACHE_DIR": str(tmp_path / "cache"),
        "OMP_NUM_THREADS": "1",
        "TMPDIR": str(tmp_path / "tmp"),
    }
    result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=600, env=environment)
    assert result.returncode == 0, result.stderr[-3000:]
    # two processes print into one pipe: a line may start after another's unterminated output
    pattern = r"step (\d+): mean reward (\S+)  process (\d): .*? drafter steps in the wait (\d+)"
    steps = re.findall(pattern, result.stdout)
    assert sorted((int(step), int(process)) for step, _, process, _ in steps) == [
        (1, 0),
        (1, 1),
        (2, 0),
        (2, 1),
        (3, 0),
        (3, 1),
    ]
    assert all(0.0 <= float(reward) <= 1.0 for _, reward, _, _ in steps)
    assert sum(int(drafter_steps) for *_, drafter_steps in steps) > 0
    checksums = re.findall(r"process \d: drafter checksum (\d+\.\d+)", result.stdout)
    assert len(checksums) == 2 and checksums[0] == checksums[1]  # the copies were averaged into one drafter
