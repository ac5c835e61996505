"""The rollout's precision: bfloat16 decoding is lossless against the bfloat16 model, and `rollout.dtype: auto`
chooses by measurement, cached per machine and model.

Lossless here means against the model in the precision that rolls out: greedy speculative decoding gives the
tokens plain bfloat16 decoding gives (chains, trees, n-gram and hybrid drafts), and sampled speculative decoding
has the bfloat16 target's law (chi-square against that law computed exactly by enumeration through the same
bfloat16 forward). A divergence in the greedy tests is reported with the gap between the two best logits at the
first differing token, so a bfloat16 tie reads as one.
"""

import json

import pytest
import torch
from scipy.stats import chisquare
from test_ngram import grouped_requests
from test_speculative import BOS, CHAINS, TREES, TargetAsDrafter, frequent_token, requests_for, tiny_target
from tiny_models import tiny_gpt2, tiny_llama

from tlt_cli.drafter.model import EagleDrafter
from tlt_cli.engine import decode_model_for
from tlt_cli.engine.sampling import SamplingParams, apply_sampling
from tlt_cli.rollout.embedded import EmbeddedRollout
from tlt_cli.rollout.generate_loop import EmbeddedEngine
from tlt_cli.rollout.types import RolloutRequest
from tlt_cli.speculative.decoder import SpeculativeDecoder
from tlt_cli.speculative.rules import parse_label
from tlt_cli.training.setup import decode_plan_for
from tlt_cli.tuning import precision
from tlt_cli.tuning.precision import CACHE_FOLDER, PrecisionChoice, RolloutWorkload, choose_dtype, rollout_precision

torch.set_num_threads(1)

BFLOAT16 = torch.bfloat16
DRAFT_SHAPES = [CHAINS[1], CHAINS[3], TREES[0], TREES[2], parse_label("ngram4"), parse_label("s2-k1-t3+ngram4")]


def generate_bf16(model, requests, params, eos_token_id, speculative=None, seed=0):
    engine = EmbeddedEngine(model, eos_token_id=eos_token_id, pad_token_id=0, speculative=speculative, dtype=BFLOAT16)
    return engine.generate(requests, params, torch.Generator().manual_seed(seed))


def first_divergence(model, speculative, plain) -> str:
    """Where the first differing row first differs, and the gap between its two best bfloat16 logits there."""
    for sd_completion, plain_completion in zip(speculative, plain, strict=True):
        if sd_completion.response_ids == plain_completion.response_ids:
            continue
        pairs = zip(sd_completion.response_ids, plain_completion.response_ids)
        index = next((i for i, (a, b) in enumerate(pairs) if a != b), len(plain_completion.response_ids))
        context = torch.tensor([[*plain_completion.prompt_ids, *plain_completion.response_ids[:index]]])
        logits = bfloat16_logits(model, context)[0, -1]
        best, second = logits.topk(2).values.tolist()
        return f"request {plain_completion.request_id} differs at token {index}; top-2 logit gap {best - second:.3g}"
    return "no difference"


def bfloat16_logits(model, sequences: torch.Tensor) -> torch.Tensor:
    """Logits [N, T, V] (float32) of whole sequences [N, T] through the owned forward in bfloat16."""
    decode_model = decode_model_for(model, dtype=BFLOAT16)
    rows, length = sequences.shape
    cache = decode_model.new_cache(rows, length)
    positions = torch.arange(length).expand(rows, length)
    causal = torch.ones(length, length, dtype=torch.bool).tril().expand(rows, 1, length, length)
    with torch.no_grad():
        return decode_model.logits(decode_model.forward_block(cache, sequences, positions, positions, length, causal))


@pytest.mark.parametrize("config", DRAFT_SHAPES, ids=lambda config: config.label().replace("+", "_"))
@pytest.mark.parametrize("family", ["qwen2", "untied-llama"])
def test_greedy_sd_is_token_identical_to_plain_bfloat16_decoding(config, family):
    target = (
        tiny_target() if family == "qwen2" else tiny_llama(64, max_position_embeddings=256, tie_word_embeddings=False)
    )
    greedy = SamplingParams(max_new_tokens=23, temperature=0.0)
    requests = grouped_requests(4, 4, seed=21)
    eos_token_id = frequent_token(generate_bf16(target, requests, greedy, eos_token_id=64))
    plain = generate_bf16(target, requests, greedy, eos_token_id)
    drafter = TargetAsDrafter(target, logit_noise=0.5) if config.uses_drafter else None
    speculative = generate_bf16(target, requests, greedy, eos_token_id, SpeculativeDecoder(drafter, config))
    assert [c.response_ids for c in speculative] == [c.response_ids for c in plain], first_divergence(
        target, speculative, plain
    )
    assert [c.finished_by_eos for c in speculative] == [c.finished_by_eos for c in plain]
    assert sum(c.speculative.accepted_draft_tokens for c in speculative) > 0


def test_bfloat16_decoding_runs_in_bfloat16_and_differs_from_float32():
    """The bfloat16 tests above would prove nothing if the engine quietly decoded in float32."""
    target = tiny_target(initializer_range=0.4)
    engine = EmbeddedEngine(target, eos_token_id=64, pad_token_id=0, dtype=BFLOAT16)
    assert engine.decode_model.dtype == BFLOAT16
    cache = engine.decode_model.new_cache(1, 8)
    ids = torch.tensor([[BOS, 5, 9]])
    positions = torch.arange(3)[None]
    causal = torch.ones(3, 3, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        hidden = engine.decode_model.forward_block(cache, ids, positions, positions, 3, causal)
    assert hidden.dtype == BFLOAT16 and cache.keys[0].dtype == BFLOAT16
    float32_logits = target(ids).logits[0].detach()
    assert not torch.equal(engine.decode_model.logits(hidden)[0], float32_logits)


def exact_three_token_law_in_bfloat16(target, prompt: tuple[int, ...], params: SamplingParams) -> torch.Tensor:
    """P(t1, t2, t3) under the bfloat16 target's processed distribution, by enumeration: [V, V, V]."""
    vocab_size = target.config.vocab_size
    first, second = torch.meshgrid(torch.arange(vocab_size), torch.arange(vocab_size), indexing="ij")
    sequences = torch.cat(
        [torch.tensor(prompt).expand(vocab_size**2, -1), first.reshape(-1, 1), second.reshape(-1, 1)], dim=1
    )
    logits = bfloat16_logits(target, sequences)[:, len(prompt) - 1 :]
    probs = apply_sampling(logits.reshape(-1, vocab_size), params).view(vocab_size, vocab_size, 3, vocab_size)
    return probs[0, 0, 0][:, None, None] * probs[:, 0, 1][:, :, None] * probs[:, :, 2]


SAMPLED_PROMPT = (BOS, 3, 5, 2, 7, 4, 6, 0, 3, 1, 5, 6, 2)
SAMPLED_SHAPES = ["s3-k1-t4", "s2-k2-t5", "ngram2", "s2-k1-t3+ngram2"]


@pytest.mark.parametrize("label", SAMPLED_SHAPES, ids=lambda label: label.replace("+", "_"))
def test_sampled_sd_has_the_bfloat16_targets_law(label):
    target = tiny_target(vocab_size=8, initializer_range=0.4)
    config = parse_label(label)
    params = SamplingParams(3, temperature=0.8, top_k=6)
    samples = 6000
    requests = [RolloutRequest(index, SAMPLED_PROMPT, group=index // 8) for index in range(samples)]
    drafter = EagleDrafter(target, seed=5) if config.uses_drafter else None
    completions = generate_bf16(target, requests, params, 8, SpeculativeDecoder(drafter, config), seed=1)
    assert sum(c.speculative.accepted_draft_tokens for c in completions) > 0
    triples = torch.tensor([c.response_ids for c in completions])
    observed = torch.bincount(triples[:, 0] * 64 + triples[:, 1] * 8 + triples[:, 2], minlength=512).double()
    expected = exact_three_token_law_in_bfloat16(target, SAMPLED_PROMPT, params).reshape(-1).double() * samples
    assert observed[expected == 0].sum() == 0
    rare, common = (expected > 0) & (expected < 5), expected >= 5
    observed = torch.cat([observed[common], observed[rare].sum()[None]])
    expected = torch.cat([expected[common], expected[rare].sum()[None]])
    assert chisquare(observed.numpy(), expected.numpy() * observed.sum().item() / expected.sum().item()).pvalue > 0.01


# (1-row step, batch step, 16-token verify) in ms per dtype, as measured on SmolLM2-135M
AMX_XEON = (
    {"float32": 64.0, "bfloat16": 66.0},
    {"float32": 64.0, "bfloat16": 66.0},
    {"float32": 158.0, "bfloat16": 80.0},
)
# an AMD EPYC with avx512_bf16, no AMX (the precision measurement, 16 rows): slower at one row, faster at 16
EPYC = ({"float32": 48.0, "bfloat16": 54.1}, {"float32": 158.1, "bfloat16": 89.0}, {"float32": 145.0, "bfloat16": 86.4})
EPYC_ONE_ROW = (EPYC[0], EPYC[0], EPYC[2])
# bfloat16 emulated without matrix support: slower in every pass
NO_BF16_UNITS = (
    {"float32": 48.0, "bfloat16": 90.0},
    {"float32": 150.0, "bfloat16": 260.0},
    {"float32": 145.0, "bfloat16": 250.0},
)
# bfloat16 faster, but by less than MARGIN over the rollout: its different samples are not worth it
MARGINAL = (
    {"float32": 50.0, "bfloat16": 50.0},
    {"float32": 100.0, "bfloat16": 93.0},
    {"float32": 100.0, "bfloat16": 93.0},
)


@pytest.mark.parametrize(
    ("figures", "speculates", "chosen"),
    [
        # an Intel Xeon with AMX (DESIGN.md; one row): verify 2.46x a step in float32, 1.21x in bfloat16
        (AMX_XEON, True, "bfloat16"),
        (EPYC, False, "bfloat16"),
        (EPYC, True, "bfloat16"),
        # one row at a time: only a speculating tail (the cheaper verify) pays for the slower step
        (EPYC_ONE_ROW, False, "float32"),
        (EPYC_ONE_ROW, True, "bfloat16"),
        (NO_BF16_UNITS, True, "float32"),
        (MARGINAL, True, "float32"),
    ],
)
def test_auto_chooses_bfloat16_where_it_makes_the_rollout_faster_by_the_margin(figures, speculates, chosen):
    assert choose_dtype(*ends_only(figures), speculates) == chosen


def ends_only(figures, rows=16):
    """(plain steps by batch size, verify) of a (1-row step, batch step, verify) triple: no rung between."""
    step, batch, verify = figures
    return {1: step, rows: batch}, verify


def test_the_predicted_speedup_weighs_the_full_batch_and_the_tail_by_their_share_of_time():
    plain, verify = ends_only(EPYC)
    # speculating: half the time at 16 rows (1.78x faster), half in verify passes (1.68x)
    expected_speculating = 1 / (0.5 * 89.0 / 158.1 + 0.5 * 86.4 / 145.0)
    # SD off: as many plain steps at each batch size of the tail (here 1 and 16 rows)
    expected_sd_off = (48.0 + 158.1) / (54.1 + 89.0)
    assert precision.bfloat16_speedup(plain, verify, True) == pytest.approx(expected_speculating)
    assert precision.bfloat16_speedup(plain, verify, False) == pytest.approx(expected_sd_off)


# plain steps by running batch size on a CPU where bfloat16 loses badly at one row and wins from two rows up
FLOAT32_STEPS = {1: 48.0, 2: 60.0, 4: 80.0, 8: 110.0, 16: 158.0}
BFLOAT16_STEPS = {1: 70.0, 2: 52.0, 4: 55.0, 8: 68.0, 16: 89.0}


def test_the_sd_off_dtype_is_chosen_by_plain_steps_at_every_batch_size_of_the_tail():
    plain = {rows: {"float32": FLOAT32_STEPS[rows], "bfloat16": BFLOAT16_STEPS[rows]} for rows in FLOAT32_STEPS}
    # every batch size a plain tail decodes at counts: bfloat16 wins at 2-16 rows, so it is chosen
    assert precision.bfloat16_speedup(plain, {}, False) == pytest.approx(456.0 / 334.0)
    assert choose_dtype(plain, {}, False) == "bfloat16"
    # the same ends with bfloat16 slower at the rows between: the rows between decide it
    slower_between = {rows: {"float32": 50.0, "bfloat16": 80.0} for rows in (2, 4, 8)}
    assert choose_dtype(plain | slower_between, {}, False) == "float32"
    # the weighing that looked at one row for the whole tail chose float32 for these figures (0.99x predicted)
    assert 1 / (0.5 * 89.0 / 158.0 + 0.5 * 70.0 / 48.0) < 1 + precision.MARGIN


def test_the_plain_rungs_are_the_powers_of_two_below_the_rows_and_the_rows():
    assert precision.plain_rungs(1) == (1,)
    assert precision.plain_rungs(6) == (1, 2, 4, 6)
    assert precision.plain_rungs(16) == (1, 2, 4, 8, 16)


def test_auto_measures_once_per_machine_model_and_batch_then_reads_the_cache(tmp_path, monkeypatch):
    target = tiny_target()
    workload = RolloutWorkload(rows=6, speculates=True)
    choice = rollout_precision("auto", target, None, tmp_path, workload)
    assert choice.reason == "measured" and choice.dtype in ("float32", "bfloat16")
    assert (choice.rows, choice.speculates) == (6, True)
    figures = (choice.step_ms, choice.batch_step_ms, choice.verify_ms, *choice.tail_step_ms.values())
    assert set(choice.tail_step_ms) == {"2", "4"}
    assert all(set(values) == {"float32", "bfloat16"} for values in figures)
    assert all(value > 0 for values in figures for value in values.values())
    assert choice.dtype == choose_dtype(choice.plain_step_ms(), choice.verify_ms, True)
    (cached,) = (tmp_path / CACHE_FOLDER).glob("*.json")
    stored = json.loads(cached.read_text())
    assert stored["key"]["rows"] == 6
    names = ("step_ms", "batch_step_ms", "verify_ms", "tail_step_ms")
    assert {name: stored[name] for name in names} == {name: getattr(choice, name) for name in names}

    def no_measuring(*arguments):
        raise AssertionError("measured again although the cache holds this machine, model and batch")

    monkeypatch.setattr(precision, "_measured_record", no_measuring)
    assert rollout_precision("auto", target, None, tmp_path, workload) == choice
    # the same figures weighed for a tail that does not speculate: read, not measured
    plain = rollout_precision("auto", target, None, tmp_path, RolloutWorkload(rows=6, speculates=False))
    assert plain.batch_step_ms == choice.batch_step_ms
    assert plain.dtype == choose_dtype(choice.plain_step_ms(), choice.verify_ms, False)
    # another batch, or another model (another vocabulary), is measured anew
    with pytest.raises(AssertionError, match="measured again"):
        rollout_precision("auto", target, None, tmp_path, RolloutWorkload(rows=2, speculates=True))
    with pytest.raises(AssertionError, match="measured again"):
        rollout_precision("auto", tiny_target(vocab_size=96), None, tmp_path, workload)


def test_batches_wider_than_the_measured_cap_share_one_measurement():
    assert RolloutWorkload(rows=64).measured_rows == RolloutWorkload(rows=precision.MAX_MEASURED_ROWS).measured_rows
    assert RolloutWorkload(rows=3).measured_rows == 3


def test_given_dtypes_are_taken_and_the_transformers_path_keeps_its_own(tmp_path):
    assert rollout_precision("bfloat16", tiny_target(), None, tmp_path) == PrecisionChoice("bfloat16", "given", {}, {})
    assert rollout_precision("float32", tiny_target(), None, tmp_path).torch_dtype == torch.float32
    gpt2 = rollout_precision("auto", tiny_gpt2(64), None, tmp_path)
    assert (gpt2.dtype, gpt2.reason) == ("float32", "model dtype: transformers path")
    assert not (tmp_path / CACHE_FOLDER).exists()
    with pytest.raises(ValueError, match="rollout.dtype must be one of auto, float32, bfloat16, got 'float16'"):
        rollout_precision("float16", tiny_target(), None, tmp_path)


def test_the_embedded_rollout_decodes_in_the_chosen_dtype_and_says_why(tmp_path):
    policy = tiny_target()
    plan = decode_plan_for(policy, None, "auto", "off", tmp_path, rows=3, speculates=False, costs=False)
    rollout = EmbeddedRollout(policy, eos_token_id=64, pad_token_id=0, decode=plan)
    record = plan.precision
    assert (record["rows"], record["speculates"]) == (3, False)
    assert rollout.engine.decode_model.dtype == PrecisionChoice(**record).torch_dtype
    lines = [*plan.log_lines, *rollout.start()]
    assert lines[0].startswith(f"rollout dtype: {record['dtype']} (measured: float32 step ")
    assert "3-row step" in lines[0] and "16-token verify" in lines[0]
    assert "a 3-row rollout, SD off, steps at 1, 2, 3 rows, predicted " in lines[0]
    completions, _ = rollout.generate(requests_for(3, seed=2), SamplingParams(5, temperature=0.0), seed=0)
    assert [len(completion.response_ids) for completion in completions] == [5, 5, 5]


def test_one_row_wide_the_batch_step_is_the_1_row_step_timed_once(tmp_path):
    choice = rollout_precision("auto", tiny_target(), None, tmp_path, RolloutWorkload(rows=1, speculates=True))
    assert choice.batch_step_ms == choice.step_ms
