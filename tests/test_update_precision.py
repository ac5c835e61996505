"""The update in bfloat16 on CPU (actor.precision bf16: autocast over float32 master weights) and `auto`
choosing it by a measurement cached per machine and model (tlt_cli/training/update_precision.py)."""

import json

import pytest
import torch
from test_actor import rollout_batch, tiny_policy

from tlt_cli.config import ActorConfig, load_recipe
from tlt_cli.integrations.trl_recipe import grpo_config_arguments
from tlt_cli.recipe_checks import load_checked_recipe
from tlt_cli.recipes import resolve_recipe_path
from tlt_cli.training import memory, setup, update_precision
from tlt_cli.training.actor import Actor
from tlt_cli.training.logprobs import head_logprobs
from tlt_cli.training.update_precision import resolve_update_precision
from tlt_cli.tuning.run_plan import UpdatePrecision
from tlt_cli.tuning.threads import torch_threads

# bfloat16 keeps 8 significant bits: rounding to nearest moves a value by at most 2^-8 of it (stochastic rounding,
# the learner's copies: by less than one step of 2^-7)
BFLOAT16_UNIT_ROUNDOFF = 2.0**-8


def bf16_learner_logprob_bound(logits: torch.Tensor, num_layers: int) -> float:
    """How far the bf16 learner's log-probs may be from float32's on the same float32 weights, derived from
    bfloat16's precision (not fitted to a machine: a CPU with bfloat16 units sums in its own order).

    In units of u = 2^-8 of a value: per decoder layer, the attention and the MLP outputs each carry their weights'
    stochastic rounding (under 2u) and their own rounding (u), and the residual add one more (7u); then the final
    norm (u) and the head, rounded to nearest by autocast, weight and product (2u): R = 7 * layers + 3 units. The
    final norm scales the residual stream to the logits' scale, so, adding up with no cancellation (the worst case),
    a logit is within R * u * max|z| of float32's, and a log-prob z_t - logsumexp(z) within twice that.
    """
    return 2 * (7 * num_layers + 3) * BFLOAT16_UNIT_ROUNDOFF * float(logits.abs().max())


def two_epoch_update(precision: str):
    """An update whose loss depends on the precision: a KL term to a reference, two epochs (ratios move); the
    actor, its weights and its response log-probs before the update, and the update's metrics."""
    config = ActorConfig(precision=precision, lr=1e-2, micro_batch_size=4, kl_coef=0.1, ppo_epochs=2)
    actor = Actor(tiny_policy(), config, sequences_per_update=6, reference=tiny_policy(seed=1))
    before = {name: value.detach().clone() for name, value in actor.policy.named_parameters()}
    logprobs_before = response_logprobs(actor)
    return actor, before, logprobs_before, actor.update(rollout_batch())


def response_logprobs(actor: Actor) -> torch.Tensor:
    """The actor's log-probs of the test batch's response tokens, in its precision."""
    batch = actor.logprobs(rollout_batch())
    return batch.old_logprobs[batch.response_mask.bool()]


def test_a_bf16_update_on_cpu_moves_every_float32_master_weight_and_its_logprobs_stay_within_bfloat16s_bound(
    single_process_group,
):
    actor, before, learner, bf16 = two_epoch_update("bf16")
    updated, _, exact, fp32 = two_epoch_update("fp32")
    # the module stays float32 (the master weights the rollout shares), every trainable parameter moved
    for name, parameter in actor.policy.named_parameters():
        assert parameter.dtype == torch.float32, name
        assert not torch.equal(parameter.detach(), before[name]), name
    # AdamW's moments and ZeRO's master partition are float32
    states = list(actor.engine.optimizer.optimizer.state.values())
    assert states and all(
        value.dtype == torch.float32 for state in states for value in state.values() if torch.is_tensor(value)
    )
    assert all(group.dtype == torch.float32 for group in actor.engine.optimizer.single_partition_of_fp32_groups)
    assert bf16.loss != fp32.loss  # the forwards ran in bfloat16
    # on the same weights the learner's bfloat16 log-probs are float32's within the bound bfloat16's precision allows
    batch = rollout_batch()
    with torch.no_grad():
        logits = tiny_policy()(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    bound = bf16_learner_logprob_bound(logits, tiny_policy().config.num_hidden_layers)
    assert learner.dtype == torch.float32 and 0 < (learner - exact).abs().max() <= bound
    # the bound can fail: the float32 update's step moves the log-probs past it
    assert (response_logprobs(updated) - exact).abs().max() > bound


def test_log_probs_under_the_bf16_updates_autocast_stay_float32_from_float32_logits():
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(40, 16, generator=generator, requires_grad=True)
    head = torch.nn.Linear(16, 96, bias=False)
    tokens = torch.randint(0, 96, (40,), generator=generator)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        chunked = head_logprobs(hidden, head, tokens, chunk_tokens=16)
    # log_softmax over the whole vocabulary at once, in float32, autocast off
    expected = torch.log_softmax(head(hidden), dim=-1).gather(1, tokens[:, None]).squeeze(1)
    assert chunked.dtype == torch.float32
    assert torch.allclose(chunked, expected, atol=1e-6)
    chunked_gradients = torch.autograd.grad(chunked.sum(), (hidden, head.weight))
    expected_gradients = torch.autograd.grad(expected.sum(), (hidden, head.weight))
    for value, reference in zip(chunked_gradients, expected_gradients):
        assert torch.allclose(value, reference, atol=1e-6)


def test_auto_measures_once_caches_per_machine_and_model_and_rereads_the_cache(tmp_path, monkeypatch):
    recipe = load_recipe(resolve_recipe_path("tiny-cpu"), ["actor.precision=auto"])
    resolved, choice = resolve_update_precision(recipe, tmp_path, lambda: setup.policy_and_tokenizer(recipe)[0])
    assert resolved.actor.precision == choice.precision in ("fp32", "bf16")
    (path,) = (tmp_path / update_precision.CACHE_FOLDER).glob("*.json")
    record = json.loads(path.read_text())
    with torch_threads(recipe.workers.threads_per_worker):  # the measurement's thread count, a worker's
        assert record["key"] == update_precision.measurement_key(recipe, torch.device("cpu"))
    assert set(record["seconds"]) == {"fp32", "bf16"} and choice.seconds == record["seconds"]
    assert choice.precision == update_precision.faster_precision(record["seconds"])

    def no_measuring(*_):
        raise AssertionError("measured again although the cache holds this machine and model")

    def no_loading():
        raise AssertionError("the policy was loaded although the cache holds this machine and model")

    monkeypatch.setattr(update_precision, "measure_update_seconds", no_measuring)
    for seconds, expected in (({"fp32": 1.0, "bf16": 0.5}, "bf16"), ({"fp32": 1.0, "bf16": 0.97}, "fp32")):
        path.write_text(json.dumps({**record, "seconds": seconds}))
        resolved, choice = resolve_update_precision(recipe, tmp_path, no_loading)
        assert (resolved.actor.precision, choice.seconds) == (expected, seconds)
        assert f"actor precision {expected} (auto: measured on this machine" in choice.describe()


def test_explicit_precisions_are_kept_and_the_actor_refuses_an_unresolved_auto(tmp_path):
    for precision in ("fp32", "bf16"):
        recipe = load_recipe(resolve_recipe_path("tiny-cpu"), [f"actor.precision={precision}"])
        assert resolve_update_precision(recipe, tmp_path, load_policy=None) == (
            recipe,
            UpdatePrecision(precision, "as the recipe sets it"),
        )
    assert not (tmp_path / update_precision.CACHE_FOLDER).exists()
    with pytest.raises(ValueError, match="resolve auto first"):
        Actor(tiny_policy(), ActorConfig(precision="auto"), sequences_per_update=2)


def test_the_memory_estimate_counts_autocasts_copies_and_the_kernel_caches_over_float32_master_state():
    recipe = load_recipe(resolve_recipe_path("tiny-cpu"), ["actor.precision=fp32"])
    shape = memory.model_shape(recipe)
    fp32 = memory.worker_peak_estimate(recipe, shape, 50)
    bf16 = memory.worker_peak_estimate(
        load_recipe(resolve_recipe_path("tiny-cpu"), ["actor.precision=bf16"]), shape, 50
    )
    # float32 weights (the master copy), gradients, AdamW state and rollout KV cache, as in fp32
    assert (bf16.weights, bf16.training_state, bf16.rollout) == (fp32.weights, fp32.training_state, fp32.rollout)
    assert bf16.weights == shape.parameters * memory.FLOAT32_BYTES
    # the update on CPU: the saved activations weigh as float32's (autocast keeps most of them float32), plus
    # autocast's bfloat16 copies of the weights and the kernel caches bfloat16 products fill
    assert bf16.update == fp32.update and bf16.autocast_casts > 0 == fp32.autocast_casts
    assert bf16.kernel_caches == memory.KERNEL_CACHE_BYTES and fp32.kernel_caches == 0
    # auto, before it is resolved: the larger of the two
    auto = load_recipe(resolve_recipe_path("tiny-cpu"), ["actor.precision=auto"])
    assert memory.worker_peak_estimate(auto, shape, 50) == max(fp32, bf16, key=lambda estimate: estimate.total_bytes)


def test_a_bf16_recipe_passes_the_checks_on_cpu_and_maps_to_trls_own_bf16(tmp_path):
    recipe = load_checked_recipe(resolve_recipe_path("tiny-cpu"), ["actor.precision=bf16", "train.trainer=trl"])
    arguments = grpo_config_arguments(recipe, processes=2, run_directory=tmp_path)
    assert arguments["bf16"] is True and arguments["use_cpu"] is True
    from trl import GRPOConfig

    # TRL allows bf16 on CPU (accelerate's bfloat16 autocast over the float32 model)
    assert GRPOConfig(**arguments).bf16


@pytest.mark.parametrize("share_prompt", [True, False])
def test_a_packing_actors_precision_is_timed_on_one_packed_micro_batch_of_whole_groups(share_prompt):
    from tlt_cli.training.packed_forward import micro_batch_count

    tokens = update_precision.MEASURED_TOKENS
    group, prompt = update_precision.MEASURED_GROUP_SIZE, update_precision.MEASURED_PROMPT_TOKENS
    packed_group = prompt + group * (tokens - prompt) if share_prompt else group * tokens
    batch = update_precision.measured_packed_micro_batch(32, 2 * packed_group + 1, share_prompt)
    # two whole groups fit the budget, each group's rows one prompt: the actor packs them as one micro-batch
    assert batch.size == 2 * group and batch.group_ids.tolist() == [0] * group + [1] * group
    for start in (0, group):
        rows = batch.input_ids[start : start + group, :prompt]
        assert (rows == rows[0]).all()
    assert micro_batch_count(batch, 2 * packed_group + 1, share_prompt) == 1
    # a budget under one group still measures one group, as the actor trains a larger group alone
    assert update_precision.measured_packed_micro_batch(32, 10, share_prompt).size == group
    config = ActorConfig(micro_batch_tokens=2 * packed_group, share_prompt=share_prompt, gradient_checkpointing=True)
    seconds = update_precision.measure_update_seconds(tiny_policy(), config, rounds=1)
    assert set(seconds) == {"fp32", "bf16"} and all(value > 0 for value in seconds.values())


@pytest.mark.parametrize(("bf16_seconds", "timed_rounds"), [(0.5, 1), (1.3, 1), (0.9, 2)])
def test_a_round_whose_precisions_are_far_apart_decides_and_a_close_one_is_timed_again(
    bf16_seconds, timed_rounds, monkeypatch
):
    timed = []

    def set_seconds(policy, batch, config, packed):
        timed.append(config.precision)
        return {"fp32": 1.0, "bf16": bf16_seconds}[config.precision]

    monkeypatch.setattr(update_precision, "_forward_backward_seconds", set_seconds)
    seconds = update_precision.measure_update_seconds(tiny_policy(), ActorConfig(), rounds=2)
    # the warm-up of each precision, then a round each: bf16 at 0.5 or 1.3 of fp32 is decided by the first,
    # at 0.9 (0.05 from the margin) it is timed again
    assert len(timed) == 2 * (1 + timed_rounds) and seconds == {"fp32": 1.0, "bf16": bf16_seconds}
