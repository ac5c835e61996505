"""The word_arithmetic task (plain-English counting stories, last-number reward) and prompts through a chat template."""

from __future__ import annotations

import re

import pytest

from tlt_cli.models.tiny import tiny_tokenizer
from tlt_cli.tasks.base import TaskOptionError
from tlt_cli.tasks.prompts import encode_prompt, uses_chat_template
from tlt_cli.tasks.registry import build_task
from tlt_cli.tasks.tail import StratifiedPowerLaw
from tlt_cli.tasks.word_arithmetic import INSTRUCTION, WordArithmeticTask

# a minimal chat template over the tiny tokenizer's characters: "a" opens the user turn, "=" asks for the answer
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}a{{ message['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"
)


def worked_answer(solution: str) -> int:
    """Replay a reference solution's arithmetic ("4 x 6 = 24, and 11 + 24 = 35.") and return its last result."""
    result = None
    for left, operator, right, claimed in re.findall(r"(\d+) ([-+x]) (\d+) = (\d+)", solution):
        left, right, claimed = int(left), int(right), int(claimed)
        result = {"+": left + right, "-": left - right, "x": left * right}[operator]
        assert result == claimed, solution
    return result


def event_count(problem) -> int:
    """Events in a problem's story (the worked example before it not counted)."""
    return problem.prompt.removeprefix(INSTRUCTION).count("Then") + 1


def test_problems_are_deterministic_stories_with_a_question():
    task, again = WordArithmeticTask(seed=3), WordArithmeticTask(seed=3)
    assert [task.problem(index) for index in range(20)] == [again.problem(index) for index in range(20)]
    assert task.problem(0) != WordArithmeticTask(seed=4).problem(0)
    for index in range(50):
        problem = task.problem(index)
        assert problem.prompt.endswith("have now?") and problem.prompt.count(".") >= 2


def test_prompts_ask_for_step_by_step_work_with_a_worked_example():
    problem = WordArithmeticTask(seed=0).problem(0)
    assert problem.prompt.startswith("Solve the problem step by step, one line per event")
    example = INSTRUCTION.partition("Solution:\n")[2]
    assert worked_answer(example) == 5 and example.strip().endswith("The answer is 5.\n\nProblem:")


def test_answers_follow_the_story_and_never_go_negative():
    task = WordArithmeticTask(seed=0, max_steps=4, max_number=30)
    for index in range(200):
        problem = task.problem(index)
        assert int(problem.answer) >= 0
        assert worked_answer(problem.solution) == int(problem.answer)
        assert problem.solution.splitlines()[-1] == f"The answer is {problem.answer}."
        assert len(problem.solution.splitlines()) == event_count(problem) + 1


def test_max_steps_bounds_the_events():
    one_step = WordArithmeticTask(seed=0, max_steps=1)
    assert all(event_count(one_step.problem(index)) == 1 for index in range(50))
    several = WordArithmeticTask(seed=0, max_steps=3)
    counts = [event_count(several.problem(index)) for index in range(300)]
    assert sorted(set(counts)) == [1, 2, 3]
    assert all(abs(counts.count(count) - 100) <= 3 for count in (1, 2, 3))


def test_tail_exponent_makes_most_stories_short_and_a_few_long():
    task = WordArithmeticTask(seed=0, max_steps=16, tail_exponent=2.0)
    counts = [event_count(task.problem(index)) for index in range(1000)]
    weights = [n**-2.0 for n in range(1, 17)]
    for events in (1, 2, 5):
        assert abs(counts.count(events) / 1000 - weights[events - 1] / sum(weights)) < 0.01
    assert max(counts) == 16
    # stratified: every eight consecutive prompts (one RL step's) hold at least one story of three or more events
    assert all(max(counts[start : start + 8]) >= 3 for start in range(0, 1000, 8))


def test_stratified_power_law_matches_its_distribution_and_its_seed():
    counts = StratifiedPowerLaw(low=2, high=6, exponent=1.0, seed=7)
    drawn = [counts.count(index) for index in range(2000)]
    weights = [1 / n for n in range(2, 7)]
    assert all(abs(drawn.count(n) / 2000 - weight / sum(weights)) < 0.002 for n, weight in zip(range(2, 7), weights))
    assert drawn != [StratifiedPowerLaw(2, 6, 1.0, seed=8).count(index) for index in range(2000)]


def test_reward_is_the_last_number_of_a_prose_answer():
    task = WordArithmeticTask(seed=0)
    problem = task.problem(0)
    answer = int(problem.answer)
    assert task.reward(problem, f"First we add, so the answer is {answer}.") == 1.0
    assert task.reward(problem, f"She has {answer} now, then {answer + 1}.") == 0.0
    assert task.reward(problem, "I do not know.") == 0.0
    assert task.reward(problem, f"{answer:,}.0") == 1.0


def test_registry_builds_it_and_checks_its_options():
    assert build_task("word_arithmetic", seed=1, options={"max_steps": 3}).max_steps == 3
    with pytest.raises(TaskOptionError, match="task.options.max_steps must be at least 1"):
        build_task("word_arithmetic", seed=0, options={"max_steps": 0})
    with pytest.raises(TaskOptionError, match="task.options.max_number must be an integer"):
        build_task("word_arithmetic", seed=0, options={"max_number": "9"})
    assert build_task("word_arithmetic", seed=1, options={"tail_exponent": 1.5}).tail_exponent == 1.5
    with pytest.raises(TaskOptionError, match="task.options.tail_exponent must be at least 0.0"):
        build_task("word_arithmetic", seed=0, options={"tail_exponent": -1.0})
    with pytest.raises(TaskOptionError, match="task.options.max_steps must be at most 48"):
        build_task("word_arithmetic", seed=0, options={"max_steps": 49})


def test_prompts_without_a_chat_template_are_the_plain_text():
    tokenizer = tiny_tokenizer()
    assert not uses_chat_template(tokenizer)
    assert encode_prompt(tokenizer, "a3b1=") == tokenizer.encode("a3b1=", add_special_tokens=False)


def test_prompts_go_through_the_chat_template_with_the_generation_prompt():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    assert uses_chat_template(tokenizer)
    assert encode_prompt(tokenizer, "3b1") == tokenizer.encode("a3b1=", add_special_tokens=False)
