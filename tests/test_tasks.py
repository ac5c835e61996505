"""Tasks: deterministic problems, the arithmetic long tail, exact rewards, JSONL errors, the registry."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import numpy as np
import pytest

from tlt_cli.tasks.arithmetic import CHARACTERS, ArithmeticTask, make_problem
from tlt_cli.tasks.base import REQUIRED
from tlt_cli.tasks.jsonl_math import JsonlMathTask, TaskDataError
from tlt_cli.tasks.registry import TASKS, TaskOptionError, UnknownTaskError, build_task

DATA_DIR = Path(__file__).parent / "data"


def test_arithmetic_problems_are_deterministic_by_seed_and_index():
    first, again, other_seed = ArithmeticTask(seed=3), ArithmeticTask(seed=3), ArithmeticTask(seed=4)
    problems = [first.problem(index) for index in range(50)]
    assert problems == [again.problem(index) for index in range(50)]
    assert problems != [other_seed.problem(index) for index in range(50)]
    assert len({problem.prompt for problem in problems}) > 25


def test_arithmetic_solution_is_the_running_sum_mod_10():
    problem = make_problem(0, [3, 1, 4, 1, 5, 9, 9])
    assert problem.prompt == "a3b1c4d1e5f9g9="
    assert problem.solution == "a3:03,b1:04,c4:08,d1:09,e5:14,f9:13,g9:12#2"
    assert problem.answer == "2"
    assert ArithmeticTask(seed=0, max_terms=7).max_solution_length == len(problem.solution)


def test_arithmetic_answers_match_their_digits_and_use_the_vocabulary():
    task = ArithmeticTask(seed=0)
    for index in range(200):
        problem = task.problem(index)
        digits = [int(character) for character in problem.prompt if character.isdigit()]
        assert problem.answer == str(sum(digits) % 10)
        assert 1 <= len(digits) <= task.max_terms
        assert set(problem.prompt + problem.solution) <= set(CHARACTERS)
        assert task.reward(problem, problem.solution) == 1.0


def test_arithmetic_solution_lengths_have_a_long_tail():
    task = ArithmeticTask(seed=0)
    lengths = np.array([len(task.problem(index).solution) for index in range(2000)])
    p50, p99 = np.percentile(lengths, [50, 99])
    assert p99 / p50 >= 5
    assert lengths.max() > 150


def test_arithmetic_term_counts_follow_the_power_law():
    task = ArithmeticTask(seed=0, max_terms=48, tail_exponent=1.5)
    term_counts = np.array([len(task.problem(index).prompt) // 2 for index in range(4000)])  # "a3b1=" has 2
    weights = np.arange(1, 49, dtype=np.float64) ** -1.5
    expected = weights / weights.sum()
    observed = np.bincount(term_counts, minlength=49)[1:] / len(term_counts)
    assert abs(observed[0] - expected[0]) < 0.02  # P(n=1) is about 0.43
    assert abs(observed[:3].sum() - expected[:3].sum()) < 0.02
    assert abs((term_counts >= 20).mean() - expected[19:].sum()) < 0.02
    # consecutive indices (one RL step's prompts) cover the tail: every window of 64 has a long problem
    assert all((term_counts[start : start + 64] >= 10).any() for start in range(0, 4000 - 64, 64))


def test_arithmetic_reward_right_wrong_and_malformed():
    task = ArithmeticTask(seed=0)
    problem = make_problem(0, [3, 1, 4, 1, 5])
    assert task.reward(problem, "a3:03,b1:04,c4:08,d1:09,e5:14#4") == 1.0
    assert task.reward(problem, " a3:03,b1:04,c4:08,d1:09,e5:14#4\n") == 1.0  # surrounding whitespace is ignored
    assert task.reward(problem, "#4") == 0.0  # the chain is required
    # a wrong answer: partial credit 0.5 x 4 of 5 right step totals
    assert task.reward(problem, "a3:03,b1:04,c4:08,d1:09,e5:15#5") == pytest.approx(0.4)
    assert task.reward(problem, "a3:03,b1:04,c4:08,d1:09,e5:14") == 0.0  # no marker
    chain = "a3:03,b1:04,c4:08,d1:09,e5:14"
    assert task.reward(problem, chain + "#4#4") == 0.0  # two markers
    assert task.reward(problem, chain + "#44") == 0.0  # trailing text after the answer
    assert task.reward(problem, "#") == 0.0


def test_arithmetic_rejects_more_terms_than_labels():
    with pytest.raises(ValueError, match="max_terms"):
        ArithmeticTask(seed=0, max_terms=100)


def test_jsonl_math_reads_the_fixture_and_rewards_the_last_number():
    task = JsonlMathTask(DATA_DIR / "math_small.jsonl", seed=0)
    problems = [task.problem(index) for index in range(len(task))]
    answers = sorted(problem.answer for problem in problems)
    assert answers == sorted(["72", "10", "1200", "-3", "2.5"])
    by_answer = {problem.answer: problem for problem in problems}
    assert by_answer["72"].prompt.startswith("Question: Natalia sold clips")
    assert task.reward(by_answer["1200"], "She pays 3 times 400, so 1,200") == 1.0
    assert task.reward(by_answer["1200"], "The answer is 1200.00") == 1.0
    assert task.reward(by_answer["1200"], "1200 is close but the answer is 1100") == 0.0
    assert task.reward(by_answer["-3"], "it drops to -3") == 1.0
    assert task.reward(by_answer["-3"], "it drops to 3") == 0.0
    assert task.reward(by_answer["2.5"], "2.50") == 1.0
    assert task.reward(by_answer["72"], "no number at all") == 0.0


def test_jsonl_math_index_wraps_with_a_seeded_permutation_per_epoch():
    task = JsonlMathTask(DATA_DIR / "math_small.jsonl", seed=0)
    size = len(task)
    first_epoch = [task.problem(index).prompt for index in range(size)]
    second_epoch = [task.problem(index).prompt for index in range(size, 2 * size)]
    assert sorted(first_epoch) == sorted(second_epoch)
    assert len(set(first_epoch)) == size
    again = JsonlMathTask(DATA_DIR / "math_small.jsonl", seed=0)
    assert [again.problem(index).prompt for index in range(2 * size)] == first_epoch + second_epoch


@pytest.mark.parametrize(
    ("lines", "bad_line", "reason"),
    [
        (['{"question": "q", "answer": "#### 1"}', '{"question": "q"'], 2, "not valid JSON"),
        (['{"question": "q", "answer": "#### 1"}', "", '{"answer": "#### 2"}'], 3, "missing the string key 'question'"),
        (['{"question": "q", "answer": "no digits here"}'], 1, "without a final number"),
        (['{"question": "q", "answer": "1 and then #### none"}'], 1, "without a final number"),
        (['["question", "answer"]'], 1, "must be a JSON object"),
    ],
)
def test_jsonl_math_bad_lines_name_the_file_and_line(tmp_path, lines, bad_line, reason):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TaskDataError, match=reason) as caught:
        JsonlMathTask(path, seed=0)
    assert f"{path}, line {bad_line}" in str(caught.value)


def test_jsonl_math_empty_and_missing_files(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(TaskDataError, match=f"{empty} is empty"):
        JsonlMathTask(empty, seed=0)
    with pytest.raises(TaskDataError, match="task.options.path: the data file .* does not exist"):
        JsonlMathTask(tmp_path / "absent.jsonl", seed=0)


def test_registry_builds_tasks_and_names_the_choices(tmp_path):
    arithmetic = build_task("arithmetic", seed=1, options={"max_terms": 8})
    assert isinstance(arithmetic, ArithmeticTask) and arithmetic.max_terms == 8
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n")
    assert build_task("jsonl_math", seed=1, options={"path": str(path)}).problem(5).answer == "2"
    with pytest.raises(UnknownTaskError, match="arithmetic, jsonl_math"):
        build_task("gsm9k", seed=0, options={})
    with pytest.raises(TaskOptionError, match="max_digits"):
        build_task("arithmetic", seed=0, options={"max_digits": 3})
    with pytest.raises(TaskOptionError, match="path"):
        build_task("jsonl_math", seed=0, options={})


@pytest.mark.parametrize("task_class", list(TASKS.values()), ids=lambda task_class: task_class.name)
def test_declared_options_are_the_constructor_keywords_with_their_defaults(task_class):
    parameters = inspect.signature(task_class).parameters
    keywords = {
        name: REQUIRED if parameter.default is parameter.empty else parameter.default
        for name, parameter in parameters.items()
        if name != "seed"
    }
    assert {option.name: option.default for option in task_class.options} == keywords


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_terms": "5"}, "task.options.max_terms must be an integer, got '5'"),
        ({"max_terms": 2.0}, "task.options.max_terms must be an integer"),
        ({"max_terms": 0}, "task.options.max_terms must be at least 1, got 0"),
        ({"max_terms": 49}, "task.options.max_terms must be at most 48"),
        ({"tail_exponent": True}, "task.options.tail_exponent must be a number"),
        ({"tail_exponent": float("nan")}, "task.options.tail_exponent must be a finite number"),
        ({"min_terms": 5, "max_terms": 3}, "task.options.min_terms (5) must not exceed task.options.max_terms (3)"),
    ],
)
def test_task_options_are_checked_by_type_and_range_naming_the_key(options, message):
    with pytest.raises(TaskOptionError) as caught:
        build_task("arithmetic", seed=0, options=options)
    assert message in str(caught.value)


def test_a_data_file_that_is_not_utf8_names_its_line(tmp_path):
    path = tmp_path / "latin.jsonl"
    path.write_bytes(b'{"question": "q", "answer": "#### 1"}\n{"question": "caf\xe9", "answer": "#### 2"}\n')
    with pytest.raises(TaskDataError, match=f"{path}, line 2 is not UTF-8 text"):
        JsonlMathTask(path, seed=0)
    with pytest.raises(TaskOptionError, match="task.options.path must be a string"):
        build_task("jsonl_math", seed=0, options={"path": 5})


def test_arithmetic_reward_requires_the_whole_chain_and_credits_a_misread_term_partially():
    from tlt_cli.tasks.arithmetic import ArithmeticTask, make_problem

    task, problem = ArithmeticTask(seed=0), make_problem(0, [3, 1, 4])
    assert task.reward(problem, "a3:03,b1:04,c4:08#8") == 1.0
    assert task.reward(problem, "#8") == 0.0  # a guess without working
    assert task.reward(problem, "a3:03,b1:04#8") == 0.0  # a skipped step
    # a misread term: a complete chain with errors, credited for its right steps, never in full
    assert task.reward(problem, "a3:03,b2:04,c4:08#8") == pytest.approx(0.5 * 2 / 3)
    assert task.reward(problem, "a3:03,b2:05,c4:09#9") == pytest.approx(0.5 * 1 / 3)
    assert task.reward(problem, "a3:03,c1:04,c4:08#8") == 0.0  # a wrong label is a skipped step


def test_min_terms_moves_the_whole_tail_up():
    task = ArithmeticTask(seed=0, min_terms=2, max_terms=12)
    counts = [(len(task.problem(index).prompt) - 1) // 2 for index in range(400)]
    assert min(counts) == 2 and max(counts) <= 12
    assert counts.count(2) > counts.count(3) > counts.count(6)  # still heavy-tailed, from 2 up
    with pytest.raises(ValueError, match="min_terms"):
        ArithmeticTask(seed=0, min_terms=13, max_terms=12)


def test_default_min_terms_keeps_the_term_counts_of_earlier_versions():
    # the cached tiny model is warmed up on these problems: its cache key assumes they never change
    task = ArithmeticTask(seed=0)
    assert [(len(task.problem(index).prompt) - 1) // 2 for index in range(12)] == [3, 1, 12, 2, 1, 5, 1, 29, 2, 1, 8, 2]
