"""Earlier responses to a prompt as n-gram draft sources (tlt_cli/rollout/response_history.py): bounded per prompt
and in prompts, handed to the n-gram proposer when the prompt comes back, lossless, saved and restored with the
rollout backend's state, and a damaged saved history is a warning and an empty one."""

from __future__ import annotations

import torch
from test_ngram import grouped_requests
from test_speculative import frequent_token, generate, tiny_target

from tlt_cli.config import SpeculativeSection
from tlt_cli.engine.sampling import SamplingParams
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
