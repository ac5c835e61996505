"""Earlier responses to a prompt as n-gram draft sources (tlt_cli/rollout/response_history.py): bounded per prompt
and in prompts, handed to the n-gram proposer when the prompt comes back, lossless, saved and restored with the
rollout backend's state, and a damaged saved history is a warning and an empty one. Only a rollout that drafts from
the n-gram index keeps one: with SD off or drafter-only configurations nothing reads it, and a checkpoint has none."""

from __future__ import annotations

import pytest
import torch
from test_ngram import grid_costs_for_widths, grouped_requests
from test_speculative import TargetAsDrafter, frequent_token, generate, tiny_target

from tlt_cli.config import SpeculativeMode, SpeculativeSection
from tlt_cli.engine.sampling import SamplingParams
from tlt_cli.rollout.decode_plan import DecodePlan
from tlt_cli.rollout.embedded import EmbeddedRollout
from tlt_cli.rollout.response_history import ResponseHistory, history_path
from tlt_cli.rollout.types import Completion, RolloutRequest
from tlt_cli.training.setup import speculative_plan

torch.set_num_threads(1)

GREEDY = SamplingParams(max_new_tokens=30, temperature=0.0)
NGRAM_ONLY = SpeculativeSection(rules=[{"batch": [1, None], "use": "ngram8"}])


def completion(prompt: tuple[int, ...], response: list[int]) -> Completion:
    return Completion(0, prompt, response, finished_by_eos=True, start=0.0, end=0.0)


def test_the_history_keeps_the_last_responses_of_the_prompts_seen_last():
    history = ResponseHistory(responses_per_prompt=2, prompts=2)
    history.record([completion((1,), [5]), completion((1,), [6]), completion((1,), [7]), completion((2,), [8])])
    history.record([completion((3,), [9]), completion((4,), [])])  # an empty response is not kept
    requests = history.attached([RolloutRequest(0, (1,)), RolloutRequest(1, (2,)), RolloutRequest(2, (3,))])
    # prompt 1 was the least recently seen of three: dropped; prompt 2 keeps its one response
    assert [[list(response) for response in request.history] for request in requests] == [[], [[8]], [[9]]]
    restored = ResponseHistory(responses_per_prompt=2, prompts=2)
    restored.load_state_dict(history.state_dict())
    assert [list(response) for response in restored.attached([RolloutRequest(0, (2,))])[0].history] == [[8]]


def accepted(completions: list[Completion]) -> int:
    return sum(completion.speculative.accepted_draft_tokens for completion in completions)


def test_a_prompt_that_comes_back_drafts_from_its_earlier_responses_and_decodes_the_same_tokens(tmp_path):
    target = tiny_target()
    requests = grouped_requests(4, 3, seed=3)
    eos_token_id = frequent_token(generate(target, requests, GREEDY, eos_token_id=64))
    plain = [completion.response_ids for completion in generate(target, requests, GREEDY, eos_token_id)]
    plan = speculative_plan(NGRAM_ONLY)
    rollout = EmbeddedRollout(target, eos_token_id, 0, plan)
    first, _ = rollout.generate(requests, GREEDY, seed=0)
    again, _ = rollout.generate(requests, GREEDY, seed=1)
    # the second epoch's drafts read the first epoch's responses: more of them accepted, the same tokens
    assert [completion.response_ids for completion in first] == plain
    assert [completion.response_ids for completion in again] == plain
    assert accepted(again) > accepted(first)
    # the backend's state keeps the history: a resumed worker drafts as the one that went on
    state = tmp_path / "adaptive-schedule-rank-0.pt"
    rollout.save_state(state)
    assert history_path(state).is_file()
    resumed = EmbeddedRollout(target, eos_token_id, 0, plan)
    resumed.load_state(state)
    went_on, _ = rollout.generate(requests, GREEDY, seed=2)
    after_resume, _ = resumed.generate(requests, GREEDY, seed=2)
    assert [completion.response_ids for completion in after_resume] == plain
    assert accepted(after_resume) == accepted(went_on)


def test_a_damaged_saved_history_is_a_warning_and_an_empty_history(tmp_path):
    target = tiny_target()
    state = tmp_path / "adaptive-schedule-rank-0.pt"
    history_path(state).write_bytes(b"\0" * 4096)
    rollout = EmbeddedRollout(target, 64, 0, speculative_plan(NGRAM_ONLY))
    rollout.load_state(state)
    (warning,) = [line for line in rollout.take_warnings() if "response history" in line]
    assert str(history_path(state)) in warning and warning.endswith("it starts empty.")
    assert rollout.history.attached([RolloutRequest(0, (1, 2))])[0].history == ()


# (speculative section, whether the rollout drafts from n-grams): mode auto's candidates include n-gram chains
SECTIONS = {
    "off": (SpeculativeSection(mode=SpeculativeMode.off), False),
    "fixed drafter": (SpeculativeSection(mode=SpeculativeMode.fixed, steps=2), False),
    "default table": (SpeculativeSection(mode=SpeculativeMode.adaptive), False),
    "n-gram table": (NGRAM_ONLY, True),
    "auto": (SpeculativeSection(mode=SpeculativeMode.auto), True),
}


@pytest.mark.parametrize("name", SECTIONS)
def test_only_a_rollout_that_drafts_n_grams_keeps_and_checkpoints_a_response_history(tmp_path, name):
    section, drafts_ngrams = SECTIONS[name]
    target = tiny_target()
    rollout = EmbeddedRollout(
        target,
        64,
        0,
        speculative_plan(section),
        TargetAsDrafter(target),
        decode=DecodePlan(pass_costs=grid_costs_for_widths()),
    )
    rollout.generate(grouped_requests(2, 2, seed=3), GREEDY, seed=0)
    state = tmp_path / "step_000000" / "adaptive-schedule-rank-0.pt"
    state.parent.mkdir()
    rollout.save_state(state)
    assert (rollout.history is not None) == drafts_ngrams
    assert history_path(state).is_file() == drafts_ngrams
    if not drafts_ngrams:
        assert [path.name for path in state.parent.iterdir()] in ([], [state.name])


def test_a_checkpoint_with_a_history_resumes_a_rollout_that_drafts_no_n_grams(tmp_path):
    target = tiny_target()
    requests = grouped_requests(2, 2, seed=3)
    ngram_rollout = EmbeddedRollout(target, 64, 0, speculative_plan(NGRAM_ONLY))
    ngram_rollout.generate(requests, GREEDY, seed=0)
    state = tmp_path / "adaptive-schedule-rank-0.pt"
    ngram_rollout.save_state(state)
    drafter_only = speculative_plan(SpeculativeSection(mode=SpeculativeMode.adaptive))
    resumed = EmbeddedRollout(target, 64, 0, drafter_only, TargetAsDrafter(target))
    resumed.load_state(state)
    assert resumed.history is None and resumed.take_warnings() == []
    completions, _ = resumed.generate(requests, GREEDY, seed=1)
    assert len(completions) == len(requests)
