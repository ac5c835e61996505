"""Model-free and hybrid drafting: the n-gram index, and SD with its proposals stays lossless."""

import json
import re

import pytest
import torch
from scipy.stats import chisquare
from test_profile import hand_made_trace, write_jsonl
from test_speculative import (
    BOS,
    TargetAsDrafter,
    assert_sd_has_the_target_law,
    frequent_token,
    generate,
    requests_for,
    tiny_target,
)
from typer.testing import CliRunner

from tlt_cli.cli import app
from tlt_cli.config import RecipeError, SpeculativeSection
from tlt_cli.drafter.model import EagleDrafter
from tlt_cli.engine.sampling import SamplingParams
from tlt_cli.profile.analysis import analyse
from tlt_cli.profile.records import load_records
from tlt_cli.recipe_checks import load_checked_recipe
from tlt_cli.recipes import resolve_recipe_path
from tlt_cli.rollout.generate_loop import EmbeddedEngine
from tlt_cli.rollout.types import RolloutRequest
from tlt_cli.sglang.adaptive import batch_rules, one_algorithm_problem, plan_for_sglang
from tlt_cli.sglang.server_args import speculative_flags
from tlt_cli.sglang.version import sglang_features
from tlt_cli.speculative.acceptance import accept_tree
from tlt_cli.speculative.cost_schedule import CostSchedule
from tlt_cli.speculative.costs import PassCosts
from tlt_cli.speculative.decoder import SpeculativeDecoder
from tlt_cli.speculative.draft_counts import StepCounts
from tlt_cli.speculative.modes import AdaptiveSpeculativeDecoder
from tlt_cli.speculative.ngram import NgramIndex
from tlt_cli.speculative.rule_schedule import AdaptiveSchedule
from tlt_cli.speculative.rules import RuleTableError, build_rules, parse_label
from tlt_cli.speculative.shapes import shape_problem
from tlt_cli.speculative.tree import DraftTree, ancestor_mask, with_chosen_chains, with_ngram_branch
from tlt_cli.speculative.types import DecodeStep, SpeculativeConfig
from tlt_cli.training.setup import speculative_plan

torch.set_num_threads(1)

MODEL_FREE = [parse_label("ngram1"), parse_label("ngram4"), parse_label("ngram32")]
HYBRID = [parse_label("s2-k1-t3+ngram4"), parse_label("s3-k2-t6+ngram3"), parse_label("s4-k4-t16+ngram2")]


def test_a_lookup_proposes_what_followed_the_longest_match():
    index = NgramIndex()
    first = index.add_sequence(group=0, prompt_ids=[5, 6, 7])
    second = index.add_sequence(group=0, prompt_ids=[5, 6, 7])
    index.extend(first, [8, 9, 10, 7, 11])
    index.extend(second, [8])
    # "7 8" occurred once (followed by 9 10 7 11); "8" alone too; the longest match wins
    assert index.propose(second, 3) == [9, 10, 7]
    assert index.propose(second, 9) == [9, 10, 7, 11]  # no more than what followed
    index.extend(second, [12])
    assert index.propose(second, 3) == []  # 12 never occurred before


def test_the_index_learns_emitted_tokens_and_prefers_the_longer_match():
    index = NgramIndex()
    first = index.add_sequence(group=0, prompt_ids=[1, 2, 3, 4])
    second = index.add_sequence(group=0, prompt_ids=[9, 2])
    # "2" alone: the prompt of `first` continues with 3
    assert index.propose(second, 2) == [3, 4]
    index.extend(first, [9, 2, 20, 21])
    # now "9 2" matched in `first`'s response: a longer match than "2"
    assert index.propose(second, 2) == [20, 21]


def test_the_most_frequent_continuation_wins_and_ties_go_to_the_most_recent():
    index = NgramIndex()
    sequences = [index.add_sequence(0, [1]) for _ in range(4)]
    for sequence, response in zip(sequences[:3], ([5, 6, 7], [5, 6, 8], [5, 9, 9])):
        index.extend(sequence, response)
    index.extend(sequences[3], [5])
    # after "1 5": 6 twice, 9 once; after "1 5 6": 7 and 8 once each, 8 the more recent
    assert index.propose(sequences[3], 3) == [6, 8]


def test_groups_do_not_see_each_other_and_a_shared_prompt_is_indexed_once():
    index = NgramIndex()
    mine = index.add_sequence("a", [1, 2])
    other = index.add_sequence("b", [1, 2])
    index.extend(other, [3, 4])
    index.extend(mine, [3])
    assert index.propose(mine, 2) == []  # "3" only occurred in group b
    siblings = [index.add_sequence("c", [7, 8, 9]) for _ in range(3)]
    places = index.groups["c"].table[(7,)]
    assert len(places) == 1  # the prompt's inner n-grams once, however many siblings share it
    assert len(index.groups["c"].table[(9,)]) == 3  # its last token: one place per sibling's response
    index.finish(siblings[0])
    index.finish(siblings[0])
    assert [index.finished_siblings(sequence) for sequence in siblings] == [0, 1, 1]


def test_a_row_repeating_itself_is_proposed_its_own_text():
    index = NgramIndex()
    sequence = index.add_sequence(0, [1])
    index.extend(sequence, [4, 5, 6, 4, 5])
    assert index.propose(sequence, 2) == [6, 4]


def test_each_row_drafts_what_its_own_match_supports():
    index = NgramIndex()
    looping = index.add_sequence(0, [1])
    index.extend(looping, [4, 5, 6, 7, 8] * 8)  # a repetition loop: its suffix matches 35 tokens back
    other = index.add_sequence(1, [2, 9, 3, 9])
    index.extend(other, [3, 9, 3])  # a short loop seen only twice: a match of 4 tokens, then the text ends
    fresh = index.add_sequence(2, [2, 10, 11, 12, 13, 14, 15, 16, 17])
    index.extend(fresh, [10])  # a one-token match, followed by 8 tokens
    assert index.propose(looping, 32) == ([4, 5, 6, 7, 8] * 7)[:32]
    assert index.propose(looping, 8) == [4, 5, 6, 7, 8, 4, 5, 6]
    assert index.propose(other, 32) == [9, 3]  # all that followed its match
    assert index.propose(fresh, 32) == [11, 12, 13, 14]  # SHORT_DRAFT
    siblings = index.add_sequence(3, [20])
    for continuation in range(12):  # 13 places continue 20, 21, each another way
        index.extend(siblings, [20, 21, 30 + continuation])
    index.extend(siblings, [20, 21, 99, 20, 21])
    # the most recent place would win the tie at one vote each, but one vote of 13 is under the share drafted
    assert index.propose(siblings, 32) == []
    assert index.propose(siblings, 1) == []


def test_a_ragged_model_free_pass_is_priced_at_the_width_its_passes_had():
    costs = grid_costs_for_widths()
    ngram32 = SpeculativeConfig(0, ngram_tokens=32)
    schedule = CostSchedule((ngram32,), costs, reprobe_steps=1, seed=0)  # every step runs ngram32
    assert schedule._prediction(ngram32, 4)[2] == pytest.approx(costs.target_seconds(4, 33))
    for _ in range(60):  # its rows drafted 0 to 5 tokens: passes 6 wide
        assert schedule(4) == ngram32
        schedule.observe_step(
            DecodeStep(4, 8, 0.01), StepCounts({"drafter": 0, "ngram": 4}, {"drafter": 0, "ngram": 4}, (0, 1, 2, 1), 6)
        )
    assert schedule._prediction(ngram32, 4)[2] == pytest.approx(costs.target_seconds(4, 6), rel=0.01)
    # a batch size it never ran at takes the label's width
    assert schedule._prediction(ngram32, 2)[2] == pytest.approx(costs.target_seconds(2, 6), rel=0.01)


def grid_costs_for_widths() -> PassCosts:
    rows, tokens = (1, 2, 4), (1, 2, 4, 8, 16, 32)
    return PassCosts(rows, tokens, tuple(tuple(5.0 + row * token for token in tokens) for row in rows))


def grouped_requests(groups: int, group_size: int, seed: int) -> list[RolloutRequest]:
    """Ragged prompts; the members of a group share a prompt but for its last token, so greedy
    responses differ and finish at different steps."""
    prompts = requests_for(groups, seed=seed)
    return [
        RolloutRequest(group * group_size + member, (*prompts[group].prompt_ids, 2 + member % 3), group=group)
        for group in range(groups)
        for member in range(group_size)
    ]


@pytest.mark.parametrize("config", MODEL_FREE + HYBRID, ids=lambda config: config.label())
def test_greedy_model_free_and_hybrid_sd_is_token_identical(config):
    target = tiny_target()
    greedy = SamplingParams(max_new_tokens=30, temperature=0.0)
    requests = grouped_requests(4, 3, seed=3)
    eos_token_id = frequent_token(generate(target, requests, greedy, eos_token_id=64))
    plain = generate(target, requests, greedy, eos_token_id)
    drafter = TargetAsDrafter(target, logit_noise=0.8) if config.uses_drafter else None
    decoder = SpeculativeDecoder(drafter, config)
    speculative = generate(target, requests, greedy, eos_token_id, decoder)
    assert [c.response_ids for c in speculative] == [c.response_ids for c in plain]
    assert [c.finished_by_eos for c in speculative] == [c.finished_by_eos for c in plain]
    assert len({len(c.response_ids) for c in plain}) > 2  # ragged: rows finished at different steps
    accepted = {source: sum(c.speculative.accepted_by_source[source] for c in speculative) for source in ("ngram",)}
    assert accepted["ngram"] > 0
    # some rows were verified while siblings of theirs had finished
    assert any(finished > 0 for finished in decoder.by_finished_siblings)
    for completion in speculative:
        stats = completion.speculative
        assert stats.passes_by_source["ngram"] == stats.verify_passes
        assert stats.passes_by_source["drafter"] == (stats.verify_passes if config.uses_drafter else 0)


def test_hybrid_trees_accept_tokens_from_both_sources():
    target = tiny_target()
    greedy = SamplingParams(max_new_tokens=30, temperature=0.0)
    requests = grouped_requests(3, 4, seed=7)
    decoder = SpeculativeDecoder(TargetAsDrafter(target, logit_noise=0.8), HYBRID[1])
    completions = generate(target, requests, greedy, 64, decoder)
    assert all(
        sum(c.speculative.accepted_by_source[source] for c in completions) > 0 for source in ("drafter", "ngram")
    )


def test_finished_siblings_stay_in_the_index_with_every_emitted_token():
    target = tiny_target()
    greedy = SamplingParams(max_new_tokens=25, temperature=0.0)
    requests = grouped_requests(3, 3, seed=5)
    eos_token_id = frequent_token(generate(target, requests, greedy, eos_token_id=64))
    decoder = SpeculativeDecoder(None, MODEL_FREE[1])
    completions = generate(target, requests, greedy, eos_token_id, decoder)
    for request, completion in zip(requests, completions):
        assert decoder.ngram_proposer.index.sequences[request.request_id] == [
            *request.prompt_ids,
            *completion.response_ids,
        ]
    assert all(decoder.ngram_proposer.index.finished_siblings(request.request_id) == 2 for request in requests)


def test_requests_without_a_group_draft_only_from_their_own_text():
    index_of_lone_rows = SpeculativeDecoder(None, MODEL_FREE[1])
    target = tiny_target()
    requests = [RolloutRequest(number, (BOS, 3, 4, 5)) for number in range(3)]
    generate(target, requests, SamplingParams(max_new_tokens=8, temperature=0.0), 64, index_of_lone_rows)
    assert len(index_of_lone_rows.ngram_proposer.index.groups) == 3


def test_an_adaptive_table_of_model_free_configurations_needs_no_drafter():
    target = tiny_target()
    rules = build_rules(
        [{"batch": [1, 4], "use": "ngram4", "candidates": ["ngram2"]}, {"batch": [5, None], "use": "off"}]
    )
    schedule = AdaptiveSchedule(rules, epsilon=0.5, collapse_accept_length=1.0)
    greedy = SamplingParams(max_new_tokens=30, temperature=0.0)
    requests = grouped_requests(2, 4, seed=9)
    eos_token_id = frequent_token(generate(target, requests, greedy, eos_token_id=64))
    plain = generate(target, requests, greedy, eos_token_id)
    adaptive = generate(target, requests, greedy, eos_token_id, AdaptiveSpeculativeDecoder(None, schedule))
    assert [c.response_ids for c in adaptive] == [c.response_ids for c in plain]
    usage = schedule.take_usage()
    assert {"off", "ngram4", "ngram2"} <= set(usage)
    assert sum(usage[label].ngram_accepted_tokens for label in ("ngram4", "ngram2")) > 0
    assert usage["ngram4"].drafter_verify_passes == 0 and usage["ngram4"].ngram_verify_passes > 0


def test_a_shape_that_needs_a_drafter_is_refused_without_one():
    with pytest.raises(ValueError, match="no drafter"):
        SpeculativeDecoder(None, HYBRID[0])
    engine = EmbeddedEngine(tiny_target(), 64, 0, SpeculativeDecoder(None, lambda batch_size: HYBRID[0]))
    with pytest.raises(ValueError, match="no drafter"):
        engine.generate(requests_for(2, seed=1), SamplingParams(4, temperature=0.0), torch.Generator())
    without_index = SpeculativeDecoder(None, lambda batch_size: MODEL_FREE[1], uses_ngram=False)
    with pytest.raises(ValueError, match="keeps no index"):
        EmbeddedEngine(tiny_target(), 64, 0, without_index).generate(
            requests_for(2, seed=1), SamplingParams(4, temperature=0.0), torch.Generator()
        )


# every token of the 8 follows some other in the prompt, so every first token has a proposal
SAMPLED_PROMPT = (BOS, 3, 5, 2, 7, 4, 6, 0, 3, 1, 5, 6, 2)
SAMPLING = [SamplingParams(3, temperature=1.0), SamplingParams(3, temperature=0.8, top_k=5, top_p=0.9)]


@pytest.mark.parametrize(
    "label", ["ngram2", "ngram32", "s2-k1-t3+ngram2", "s2-k3-t6+ngram2"], ids=lambda label: label.replace("+", "_")
)
@pytest.mark.parametrize("params", SAMPLING, ids=["plain", "top-k-top-p"])
def test_sampled_model_free_and_hybrid_sd_keep_the_target_distribution(label, params):
    target = tiny_target(vocab_size=8, initializer_range=0.4)
    config = parse_label(label)
    drafter = EagleDrafter(target, seed=5) if config.uses_drafter else None
    completions = assert_sd_has_the_target_law(target, drafter, config, params, prompt=SAMPLED_PROMPT, group_size=8)
    ngram_accepted = sum(c.speculative.accepted_by_source["ngram"] for c in completions)
    assert 0 < ngram_accepted < sum(c.speculative.verify_passes for c in completions) * config.ngram_tokens


def test_parse_label_reads_model_free_and_hybrid_labels_back():
    for label in ("ngram4", "s2-k1-t3+ngram4", "s4-k2-t8+ngram2", "s4-k1-t5", "s2-k1-t3|ngram4"):
        assert parse_label(label).label() == label
    assert parse_label("s2-k1-t3|ngram4") == SpeculativeConfig(2, 1, 3, ngram_tokens=4, picks_source=True)
    # one source per row verifies chains: a tree shape or a missing n-gram part is refused
    assert "topk 1, not 2" in shape_problem(parse_label("s2-k2-t4|ngram4"))
    with pytest.raises(RuleTableError, match="joined by |"):
        parse_label("s2-k1-t3|")
    assert parse_label("ngram3") == SpeculativeConfig(0, ngram_tokens=3)
    assert parse_label("s2-k1-t3+ngram4").drafter_part == SpeculativeConfig(2, 1, 3)


def test_an_ngram_branch_merges_where_it_meets_drafted_tokens_and_rows_are_padded():
    # root 10 with drafted children 11 (then 12) and 13
    tree = DraftTree(
        tokens=torch.tensor([[10, 11, 13, 12]]).repeat(2, 1),
        parents=torch.tensor([[0, 0, 0, 1]]).repeat(2, 1),
        depths=torch.tensor([[0, 1, 1, 2]]).repeat(2, 1),
        ancestors=ancestor_mask(torch.tensor([[0, 0, 0, 1]]), 2).repeat(2, 1, 1),
        draft_probs=None,
    )
    grafted = with_ngram_branch(tree, [[11, 14, 15], []])
    # row 0: 11 is the drafter's node, 14 and 15 hang below it; row 1 proposed nothing: two padding nodes
    assert grafted.tokens[0].tolist() == [10, 11, 13, 12, 14, 15]
    assert grafted.parents[0].tolist() == [0, 0, 0, 1, 1, 4]
    assert grafted.depths[0].tolist() == [0, 1, 1, 2, 2, 3]
    assert grafted.valid.tolist() == [[True] * 6, [True] * 4 + [False] * 2]
    drafter, ngram = grafted.sources[0].T.tolist()
    assert drafter == [False, True, True, True, False, False]
    assert ngram == [False, True, False, False, True, True]
    assert grafted.ancestors[0, 5].tolist() == [True, True, False, False, True, True]


def test_tlt_profile_shows_accept_length_by_draft_source(tmp_path):
    records = hand_made_trace()
    records += [
        {
            "type": "sd_config",
            "step": 0,
            "worker": 1,
            "config": "s2-k1-t3+ngram4",
            "seconds": 1.0,
            "decode_steps": 10,
            "drafter_verify_passes": 40,
            "drafter_accepted_tokens": 30,
            "ngram_verify_passes": 40,
            "ngram_accepted_tokens": 20,
        },
        {
            "type": "sd_config",
            "step": 0,
            "worker": 0,
            "config": "ngram4",
            "seconds": 1.0,
            "decode_steps": 10,
            "ngram_verify_passes": 60,
            "ngram_accepted_tokens": 30,
        },
    ]
    write_jsonl(tmp_path / "trace.jsonl", records)
    profile = analyse(load_records(tmp_path))
    by_config = {entry.config: entry.accept_length_by_source for entry in profile.sd_time}
    assert by_config["s2-k1-t3+ngram4"] == {"drafter": 1.75, "ngram": 1.5}
    assert by_config["ngram4"] == {"ngram": 1.5} and by_config["off"] == {}
    assert profile.accept_length_by_source == {"drafter": 1.75, "ngram": 1.5}
    result = CliRunner().invoke(app, ["profile", str(tmp_path), "--no-plots"])
    assert result.exit_code == 0, result.output
    assert "accept length by draft source (its own drafts only): drafter 1.75, ngram 1.50" in result.output


def test_trl_prompts_repeated_num_generations_times_are_one_group_each():
    from tlt_cli.integrations.trl import grouped_requests

    # TRL 1.16's RepeatSampler hands each prompt num_generations times in a row
    requests = grouped_requests([[1, 2], [1, 2], [1, 2], [5], [5], [5]])
    assert [request.group for request in requests] == [0, 0, 0, 1, 1, 1]
    assert [request.request_id for request in requests] == list(range(6))


def test_sglang_runs_model_free_tables_with_its_ngram_flags():
    rules = batch_rules(
        speculative_plan(
            SpeculativeSection(rules=[{"batch": [1, 8], "use": "ngram4"}, {"batch": [9, None], "use": "off"}])
        )
    )
    plan = plan_for_sglang(rules, sglang_features("0.5.23"))
    assert plan.mode == "ngram" and plan.launch == SpeculativeConfig(0, ngram_tokens=4)
    assert any("one per server" in difference for difference in plan.differences)
    flags = speculative_flags(plan, draft_model_path=None, adaptive_config_path=None)
    assert flags == [
        "--speculative-algorithm",
        "NGRAM",
        "--speculative-num-draft-tokens",
        "5",
        "--speculative-ngram-min-match-window-size",
        "1",
        "--speculative-ngram-max-match-window-size",
        "4",
        "--speculative-ngram-min-bfs-breadth",
        "1",
        "--speculative-ngram-max-bfs-breadth",
        "1",
    ]


@pytest.mark.parametrize(
    ("uses", "message"),
    [
        (["s2-k1-t3+ngram4", "off"], "both the n-gram index and the drafter"),
        (["off", "s2-k1-t3|ngram4"], "s2-k1-t3|ngram4 drafts with both the n-gram index and the drafter"),
        (["ngram4", "s2-k1-t3"], "mixes"),
    ],
)
def test_sglang_refuses_hybrid_and_mixed_tables_in_one_sentence(uses, message):
    rules = [{"batch": [1, 8], "use": uses[0]}, {"batch": [9, None], "use": uses[1]}]
    plan = speculative_plan(SpeculativeSection(rules=rules))
    assert re.search(message, one_algorithm_problem(plan.configs))
    with pytest.raises(ValueError, match=message):
        batch_rules(plan)
    # the recipe checks refuse it, naming the key
    sglang = ["rollout.backend=sglang", "rollout.sglang.colocated=false", "rollout.sglang.gpus=[0,1]"]
    with pytest.raises(RecipeError, match=f"^speculative.rules: .*{message}"):
        load_checked_recipe(resolve_recipe_path("tiny-cpu"), [*sglang, f"speculative.rules={json.dumps(rules)}"])


@pytest.mark.parametrize("ngram_token", [0, 5])  # tokens the target likes more than the drafter: r(y) > 0
@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_a_sampled_drafter_child_then_an_ngram_child_emit_the_target_law(ngram_token, temperature):
    # one node, two candidates: x ~ q (the drafter's sampled chain) first, then the n-gram's y on the
    # residual norm(max(p - q, 0)); where y == x the two are one node. The first token must follow p.
    rows, vocab_size = 40000, 8
    generator = torch.Generator().manual_seed(3)
    params = SamplingParams(2, temperature=temperature)
    target_logits = torch.tensor([2.0, 0.5, 1.5, -1.0, 0.0, 1.0, -0.5, 0.3]).expand(rows, 3, vocab_size)
    q = torch.softmax(torch.tensor([0.0, 1.0, 2.5, 0.5, -1.0, 0.2, 1.5, 0.0]), dim=0)
    drafted = torch.multinomial(q.expand(rows, -1), 1, replacement=True, generator=generator).squeeze(1)
    root = torch.zeros(rows, dtype=torch.long)
    tree = DraftTree(
        tokens=torch.stack([root, drafted, torch.full_like(root, ngram_token)], dim=1),
        parents=torch.zeros(rows, 3, dtype=torch.long),
        depths=torch.tensor([0, 1, 1]).expand(rows, -1),
        ancestors=ancestor_mask(torch.zeros(rows, 3, dtype=torch.long), 1),
        draft_probs=q.expand(rows, 1, -1),
        # the n-gram node exists only where it differs from the drafted token (else they merge)
        valid=torch.stack([root == 0, root == 0, drafted != ngram_token], dim=1),
    )
    verdict = accept_tree(tree, target_logits, params, generator)
    first = torch.where(
        verdict.accept_length > 0, tree.tokens.gather(1, verdict.path[:, 1:2]).squeeze(1), verdict.bonus
    )
    observed = torch.bincount(first, minlength=vocab_size).double()
    expected = torch.softmax(target_logits[0, 0].double() / temperature, dim=0) * observed.sum()
    assert chisquare(observed.numpy(), expected.numpy()).pvalue > 0.01
    # both kinds of candidate were kept now and then
    kept = verdict.path[:, 1][verdict.accept_length > 0]
    assert bool((kept == 1).any()) and bool((kept == 2).any())


PICKS_SOURCE = [parse_label("s2-k1-t3|ngram4"), parse_label("s3-k1-t4|ngram2")]


@pytest.mark.parametrize("config", PICKS_SOURCE, ids=lambda config: config.label())
def test_greedy_sd_with_one_source_per_row_is_token_identical(config):
    target = tiny_target()
    greedy = SamplingParams(max_new_tokens=30, temperature=0.0)
    requests = grouped_requests(4, 3, seed=3)
    eos_token_id = frequent_token(generate(target, requests, greedy, eos_token_id=64))
    plain = generate(target, requests, greedy, eos_token_id)
    decoder = SpeculativeDecoder(TargetAsDrafter(target, logit_noise=0.8), config)
    speculative = generate(target, requests, greedy, eos_token_id, decoder)
    assert [c.response_ids for c in speculative] == [c.response_ids for c in plain]
    assert [c.finished_by_eos for c in speculative] == [c.finished_by_eos for c in plain]
    for completion in speculative:
        stats = completion.speculative
        # every verify pass drafted from exactly one source
        assert stats.passes_by_source["drafter"] + stats.passes_by_source["ngram"] == stats.verify_passes
    for source in ("drafter", "ngram"):
        assert sum(c.speculative.accepted_by_source[source] for c in speculative) > 0


@pytest.mark.parametrize("params", SAMPLING, ids=["plain", "top-k-top-p"])
def test_sampled_sd_with_one_source_per_row_keeps_the_target_distribution(params):
    target = tiny_target(vocab_size=8, initializer_range=0.4)
    config = parse_label("s2-k1-t3|ngram2")
    # the short prompt leaves some rows without an n-gram proposal at their second step: those verify the
    # drafter's chain in the same pass as rows verifying n-gram chains
    completions = assert_sd_has_the_target_law(target, EagleDrafter(target, seed=5), config, params, group_size=8)
    first_passes = len(completions)  # every row tries the drafter first
    assert sum(c.speculative.passes_by_source["drafter"] for c in completions) > first_passes
    assert sum(c.speculative.passes_by_source["ngram"] for c in completions) > 0


@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_rows_verifying_sampled_drafts_beside_rows_verifying_ngram_drafts_emit_the_target_law(temperature):
    # one verify pass, half the rows a sampled drafter chain x1 ~ q, x2 ~ q, half an n-gram chain (point
    # masses 5, 2): the first emitted token of either kind of row must follow p
    rows, vocab_size = 40000, 8
    generator = torch.Generator().manual_seed(4)
    params = SamplingParams(3, temperature=temperature)
    target_logits = torch.tensor([2.0, 0.5, 1.5, -1.0, 0.0, 1.0, -0.5, 0.3]).expand(rows, 4, vocab_size)
    q = torch.softmax(torch.tensor([0.0, 1.0, 2.5, 0.5, -1.0, 0.2, 1.5, 0.0]), dim=0)
    drafted = torch.multinomial(q.expand(rows, -1), 2, replacement=True, generator=generator)
    root = torch.zeros(rows, 1, dtype=torch.long)
    chain = DraftTree(
        tokens=torch.cat([root, drafted], dim=1),
        parents=torch.tensor([0, 0, 1]).expand(rows, -1),
        depths=torch.tensor([0, 1, 2]).expand(rows, -1),
        ancestors=torch.ones(3, 3, dtype=torch.bool).tril(),
        draft_probs=q.expand(rows, 2, -1),
    )
    ngram_rows = torch.arange(rows) % 2 == 1
    tree = with_chosen_chains(chain, [[5, 2, 7]] * rows, ngram_rows)
    verdict = accept_tree(tree, target_logits, params, generator)
    first = torch.where(
        verdict.accept_length > 0, tree.tokens.gather(1, verdict.path[:, 1:2]).squeeze(1), verdict.bonus
    )
    law = torch.softmax(target_logits[0, 0].double() / temperature, dim=0)
    for kind in (ngram_rows, ~ngram_rows):
        observed = torch.bincount(first[kind], minlength=vocab_size).double()
        assert chisquare(observed.numpy(), (law * observed.sum()).numpy()).pvalue > 0.01
        assert 0 < int((verdict.accept_length[kind] > 0).sum()) < int(kind.sum())
    # an n-gram row keeps its proposals in order; a drafter row never reaches past its two drafts
    assert bool((tree.tokens[ngram_rows, 1:] == torch.tensor([5, 2, 7])).all())
    assert int(verdict.accept_length[~ngram_rows].max()) <= 2


def test_an_adaptive_table_counts_one_source_per_row_passes_by_source():
    target = tiny_target()
    schedule = AdaptiveSchedule(build_rules([{"batch": [1, None], "use": "s2-k1-t3|ngram4"}]))
    greedy = SamplingParams(max_new_tokens=30, temperature=0.0)
    requests = grouped_requests(2, 4, seed=9)
    eos_token_id = frequent_token(generate(target, requests, greedy, eos_token_id=64))
    plain = generate(target, requests, greedy, eos_token_id)
    decoder = AdaptiveSpeculativeDecoder(TargetAsDrafter(target, logit_noise=0.8), schedule)
    adaptive = generate(target, requests, greedy, eos_token_id, decoder)
    assert [c.response_ids for c in adaptive] == [c.response_ids for c in plain]
    usage = schedule.take_usage()["s2-k1-t3|ngram4"]
    row_passes = sum(c.speculative.verify_passes for c in adaptive)
    # each row's verify pass drafted from one source: the sources' passes add up to the rows' passes
    assert usage.drafter_verify_passes + usage.ngram_verify_passes == row_passes
    assert usage.drafter_verify_passes > 0 and usage.ngram_verify_passes > 0
