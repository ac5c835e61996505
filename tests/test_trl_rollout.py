"""tlt's rollout under TRL's real GRPOTrainer (rollout_func), on tiny models the tests build.

The contract: TRL trains every parameter on exactly the completions tlt generated, with the
log-probs tlt returned equal to the policy's own; after TRL's optimizer step the engine decodes as transformers
does on the updated module in the rollout's dtype (float32: the same greedy tokens; bfloat16: the same log-probs
within a bound derived from its precision, greedy up to near-ties, as holds on every CPU; with and without linear
forms and the drafter); tlt train's trainer measures the rollout/learner mismatch and folds the native loop's truncated
importance weights into its loss, while under TRL's own trainer `auto` keeps the policy's dtype;
chat templates applied as TRL applies them;
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
from tlt_cli.engine.linear_forms import TRANSPOSED, LinearFormPlan, linear_layers, shape_key
from tlt_cli.engine.rounding import parameter_key, stochastic_bfloat16
from tlt_cli.integrations import trl_drafter, trl_support
from tlt_cli.integrations.trl import tlt_rollout
from tlt_cli.integrations.trl_support import UnsupportedTrlError, UnsupportedTrlSettingError
from tlt_cli.integrations.trl_trainer import TimedGRPOTrainer
from tlt_cli.models.tiny import build_tiny_model, tiny_model_config, tiny_tokenizer
from tlt_cli.speculative.plan import SpeculationMode
from tlt_cli.training.rollout_correction import importance_weights
from tlt_cli.tuning import linear_forms as tuned_linear_forms
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


def grpo_trainer(model, tokenizer, rollout, reward, prompts, tmp_path, trainer_class=GRPOTrainer, **settings):
    settings = {"max_steps": 2, "learning_rate": 1e-2, **settings}
    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=12,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        bf16=False,
        logging_steps=1,
        disable_tqdm=True,
        **settings,
    )
    dataset = Dataset.from_dict({"prompt": prompts})
    return trainer_class(
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
    # the rule table (mode auto might keep SD off on this machine's costs): SD runs under TRL
    rollout = tlt_rollout(speculative={"mode": "adaptive"}, drafter="random", seed=0, dtype="float32")
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


PROMPTS = ["a1b2=", "a3b4c5=", "a6=", "a7b8c9d1="]
# bfloat16 keeps 8 significant bits: rounding to nearest moves a value by at most 2^-8 of it
BFLOAT16_UNIT_ROUNDOFF = 2.0**-8


def bfloat16_logprob_bound(logits: torch.Tensor, num_layers: int) -> float:
    """How far two bfloat16 implementations' log-probs of the same tokens may differ, on the same bfloat16 weights
    (derived from bfloat16's precision, not fitted to a machine).

    Both compute with the same rounded weights; they differ only in where they round intermediates to bfloat16
    and in the order they sum (a CPU with bfloat16 units sums in its own order; one without converts to float32).
    Each rounding moves a value by at most u = 2^-8 of it. On its way to a logit a value is rounded R times after
    the point where the two may part: per decoder layer its attention output, its MLP output and the residual
    add (3), then the final norm and the head's product (2); R = 3 * layers + 2. The final norm scales the residual
    stream to the logits' scale, so, errors adding up with no cancellation (the worst case), each implementation's
    logit is within R * u * max|z| of the exact one, and the two within twice that. A log-prob z_t - logsumexp(z)
    moves by at most twice its logits' largest move: 4 * R * u * max|z| (0.4 for this test's logits of about 3;
    the engine and transformers differ by about 0.015 on an AVX2-only EPYC, the weights before the update by 1.5).
    """
    roundings = 3 * num_layers + 2
    return 4 * roundings * BFLOAT16_UNIT_ROUNDOFF * float(logits.abs().max())


def assert_bfloat16_logprobs_agree(output: dict, reference, stale, trainer) -> None:
    """Teacher-forced on the engine's own completions: its log-probs are the reference's within the bfloat16 bound,
    and each greedy token is the reference's top token or within the bound of it (a near-tie, which two bfloat16
    implementations may break apart; so tokens are not compared). The weights before the optimizer step give
    log-probs past the bound (the check can fail: it sees a stale engine)."""
    stale_gaps = []
    for prompt_ids, completion_ids, logprobs in zip(output["prompt_ids"], output["completion_ids"], output["logprobs"]):
        with torch.no_grad():
            logits = reference(torch.tensor([prompt_ids + completion_ids])).logits[0, len(prompt_ids) - 1 : -1]
        scaled = logits.float() / trainer.temperature
        bound = bfloat16_logprob_bound(scaled, reference.config.num_hidden_layers)
        every_logprob = scaled.log_softmax(-1)
        expected = every_logprob.gather(1, torch.tensor(completion_ids)[:, None]).squeeze(1)
        assert (torch.tensor(logprobs) - expected).abs().max() <= bound
        assert (every_logprob.max(-1).values - expected).max() <= bound  # greedy up to a near-tie
        (stale_logprobs,) = logprobs_under(stale, [prompt_ids], [completion_ids], trainer.temperature)
        stale_gaps.append(float((torch.tensor(logprobs) - stale_logprobs).abs().max()) / bound)
    assert max(stale_gaps) > 1, "the bound cannot tell the updated weights from the ones before the step"


def assert_float32_greedy_and_logprobs_equal(output: dict, reference, trainer) -> None:
    """float32 has no near-ties at this model's scale: the engine's greedy tokens are transformers' own."""
    for prompt_ids, completion_ids, logprobs in zip(output["prompt_ids"], output["completion_ids"], output["logprobs"]):
        with torch.no_grad():
            generated = reference.generate(
                torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=12, pad_token_id=0
            )[0, len(prompt_ids) :].tolist()
        assert completion_ids == cut_at_eos(generated, trainer.eos_token_ids)
        (expected,) = logprobs_under(reference, [prompt_ids], [completion_ids], trainer.temperature)
        assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-4)


def policy_with(model, weights: dict[str, torch.Tensor]):
    """A new transformers module of `model`'s class with `weights` (its parameters' values at some earlier time)."""
    copy = type(model)(model.config)
    loaded = copy.load_state_dict(weights, strict=False)
    assert loaded.missing_keys in ([], ["lm_head.weight"]) and not loaded.unexpected_keys  # a tied head: no parameter
    copy.tie_weights()
    copy.generation_config = model.generation_config
    return copy


def spread_policy(seed: int):
    """tiny_policy with its matrices spread 8x: distinct greedy paths, and an optimizer step that changes them."""
    model, tokenizer = tiny_policy(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.mul_(8.0)
    return model, tokenizer


def transformers_copy(model, dtype: torch.dtype):
    """A new transformers module with `model`'s current weights, cast to `dtype` as the engine casts them (a
    deepcopy of a module TRL prepared would keep calling the original's forward through accelerate's wrapper)."""
    copy = type(model)(model.config)
    copy.load_state_dict(model.state_dict())
    copy.generation_config = model.generation_config
    copy = copy.to(dtype).eval()
    if dtype == torch.bfloat16:  # as the engine's copies round: stochastically (tlt_cli/engine/rounding.py)
        with torch.no_grad():
            for (name, source), target in zip(model.named_parameters(), copy.parameters(), strict=True):
                target.copy_(stochastic_bfloat16(source, parameter_key(name)))
    return copy


def transposed_plan(mode, modules, cache_dir):
    """Every linear layer of the policy and drafter in the transposed form, in both dtypes: the copies a
    refresh must rewrite."""
    keys = {shape_key(layer.weight) for layer in linear_layers(modules)}
    return LinearFormPlan.uniform(TRANSPOSED, keys | {key.replace("float32", "bfloat16") for key in keys})


def cut_at_eos(ids: list[int], eos_ids: list[int]) -> list[int]:
    ends = [index for index, token in enumerate(ids) if token in eos_ids]
    return ids[: ends[0] + 1] if ends else ids


@pytest.mark.parametrize("engine", ["plain", "forms-and-drafter"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_after_a_trl_optimizer_step_the_engine_decodes_as_transformers_on_the_updated_module(
    tmp_path, monkeypatch, dtype, engine
):
    monkeypatch.setenv("TLT_CACHE_DIR", str(tmp_path / "cache"))
    speculates = engine == "forms-and-drafter"
    if speculates:
        monkeypatch.setattr(tuned_linear_forms, "measured_linear_plan", transposed_plan)
    model, tokenizer = spread_policy(1)
    before = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    rollout = tlt_rollout(
        speculative={"mode": "fixed", "steps": 3} if speculates else {"mode": "off"},
        drafter="random",
        dtype=dtype,
        linear_forms="auto" if speculates else "off",
    )

    def reward(completion_ids, **_):
        # position-weighted, so two different completions of a group almost never tie (every advantage 0: no step)
        return [float(sum((index + 1) * token for index, token in enumerate(ids)) % 101) for ids in completion_ids]

    trainer = grpo_trainer(model, tokenizer, rollout, reward, PROMPTS * 2, tmp_path, max_steps=1)
    trainer.train()  # one sampled rollout, then TRL's optimizer step
    unchanged = [name for name, parameter in model.named_parameters() if torch.equal(parameter, before[name])]
    assert unchanged == []

    trainer.args.generation_kwargs = {"do_sample": False}
    output = rollout(PROMPTS, trainer)
    if dtype == "bfloat16":
        stale = transformers_copy(policy_with(model, before), torch.bfloat16)
        assert_bfloat16_logprobs_agree(output, transformers_copy(model, torch.bfloat16), stale, trainer)
    else:
        assert_float32_greedy_and_logprobs_equal(output, transformers_copy(model, torch.float32), trainer)
    if speculates:
        assert sum(request.verify_passes for request in rollout.take_records()[-1].requests) > 0


def test_tlt_trains_trainer_measures_the_mismatch_and_weights_the_loss_as_the_native_loop(tmp_path, monkeypatch):
    monkeypatch.setenv("TLT_CACHE_DIR", str(tmp_path / "cache"))
    model, tokenizer = spread_policy(2)
    rollout = tlt_rollout(speculative={"mode": "off"}, drafter="random", dtype="bfloat16", linear_forms="off")
    returned, learner, scored = [], [], []

    class ScoredTrainer(TimedGRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            scored.append(super()._generate_and_score_completions(inputs))
            return scored[-1]

    def recorded_rollout(prompts, trainer):
        returned.append(rollout(prompts, trainer))
        return returned[-1]

    def reward(completion_ids, **_):
        learner.append(logprobs_under(model, returned[-1]["prompt_ids"], completion_ids, temperature=1.0))
        return [float(sum(ids) % 7) for ids in completion_ids]

    cap = 1.01  # low enough that some of the bfloat16 rollout's weights are truncated
    trainer = grpo_trainer(
        model,
        tokenizer,
        recorded_rollout,
        reward,
        PROMPTS * 2,
        tmp_path,
        trainer_class=ScoredTrainer,
        max_steps=1,
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_max=cap,
    )
    trainer.train()

    (generation,) = trainer.take_generations()
    mismatch = generation.mismatch
    assert mismatch["rollout_kl_k3"] > 0 and 0 < mismatch["rollout_weight_truncated"] < 1
    assert mismatch["rollout_weight_min"] < 1 < mismatch["rollout_weight_max"]
    advantages = torch.tensor(list(trainer._logs["advantages"]))  # TRL's own, before the weights
    weighted = scored[0]["advantages"]
    for row, (logprobs, learner_logprobs) in enumerate(zip(returned[0]["logprobs"], learner[0])):
        rollout_logprobs = torch.tensor(logprobs)
        mask = torch.ones(1, len(logprobs))
        weights = importance_weights(learner_logprobs[None], rollout_logprobs[None], mask, "token", cap)[0]
        assert torch.allclose(weighted[row, : len(logprobs)], advantages[row] * weights, atol=1e-5)
        assert not torch.allclose(weights, torch.ones_like(weights))


def test_auto_keeps_the_policy_dtype_under_trls_own_trainer_which_cannot_correct_the_mismatch(tmp_path, monkeypatch):
    monkeypatch.setenv("TLT_CACHE_DIR", str(tmp_path / "cache"))
    model, tokenizer = tiny_policy()
    for trainer_class, reason in (
        (GRPOTrainer, "model dtype: the trainer cannot correct"),
        (TimedGRPOTrainer, "measured"),
    ):
        rollout = tlt_rollout(speculative={"mode": "off"}, drafter="random", dtype="auto", linear_forms="off")
        trainer = grpo_trainer(
            model,
            tokenizer,
            rollout,
            lambda completions, **_: [0.0] * len(completions),
            PROMPTS,
            tmp_path,
            trainer_class=trainer_class,
        )
        rollout(PROMPTS, trainer)
        assert rollout.decode.precision["reason"] == reason
        assert reason == "measured" or rollout.decode.precision["dtype"] == "float32"


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
    # the rule table's schedule, whose bucket state the checkpoint carries
    rollout = tlt_rollout(speculative={"mode": "adaptive"}, drafter="random", seed=0, dtype="float32")
    trainer = grpo_trainer(
        model, tokenizer, rollout, lambda completions, **_: [0.0] * len(completions), ["a1="], tmp_path
    )
    for _ in range(2):
        rollout(["a1b2=", "a1b2=", "a3=", "a3="], trainer)
    rollout.save_state(tmp_path / "checkpoint", process=0)
    assert (tmp_path / "checkpoint" / "drafter" / "drafter_config.json").is_file()  # what tlt export-drafter reads

    resumed = tlt_rollout(
        speculative={"mode": "adaptive"}, drafter="random", seed=7, dtype="float32"
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


def test_tlt_rollout_starts_without_a_warm_up_and_says_what_it_does(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TLT_CACHE_DIR", str(tmp_path / "cache"))

    def no_warm_up(*arguments, **settings):
        raise AssertionError("tlt_rollout() warmed up a drafter it was not asked for")

    monkeypatch.setattr(trl_drafter, "_warmed_up", no_warm_up)
    model, tokenizer = tiny_policy()
    rollout = tlt_rollout(dtype="float32", linear_forms="off")
    assert rollout.drafter_source == "online"
    reward = lambda completions, **_: [float(len(completion)) for completion in completions]  # noqa: E731
    trainer = grpo_trainer(model, tokenizer, rollout, reward, ["a1b2", "a3b4"] * 2, tmp_path, max_steps=1)
    trainer.train()
    printed = capsys.readouterr().out
    assert "tlt rollout: planning how to decode" in printed and "tlt rollout: ready in " in printed
    assert "warming up" not in printed and rollout.drafter is not None
