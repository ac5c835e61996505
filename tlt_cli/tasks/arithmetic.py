"""The built-in arithmetic task: a running sum mod 10 whose chain of thought has a long tail.

A problem is a list of n labelled digits, `a3b1c4d1e5=`; the reference solution walks the
list one step per digit, restating the label and digit and writing the previous running sum
plus the digit as two digits (`b1:04`), whose last digit is the new running sum mod 10; then
the answer marker and the answer: `a3:03,b1:04,c4:08,d1:09,e5:14#4`. Writing the unreduced
total gives gradient descent a carry digit that depends smoothly on both operands, which a
bare mod-10 digit (parity-like in its operands) does not. The number of digits n is
heavy-tailed, P(n) ~ n^-tail_exponent on min_terms..max_terms, so most solutions are a few steps
long and a few run to dozens of steps: the rollout long tail in miniature. Labels
(a..z, A..V) let a small model find the next digit by content instead of by counting, which
keeps the built-in tiny model's warm-up short. The worker loop and the tiny-model builder use it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tlt_cli.tasks.base import Problem, TaskOption, TaskOptionError, check_option_values
from tlt_cli.tasks.tail import StratifiedPowerLaw

# one label per digit position; max_terms is bounded by their number
LABELS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUV"
DIGITS = "0123456789"
QUESTION_END = "="
STEP_SEPARATOR = ","
SUM_SEPARATOR = ":"
ANSWER_MARKER = "#"
# most a complete chain with a wrong answer can score (scaled by its share of right step totals)
PARTIAL_CREDIT = 0.5
# every character a prompt or a solution can contain (the tiny model's vocabulary)
CHARACTERS = DIGITS + LABELS + QUESTION_END + STEP_SEPARATOR + SUM_SEPARATOR + ANSWER_MARKER


class ArithmeticTask:
    """Running sum mod 10 over a heavy-tailed number of labelled digits.

    Example:
        task = ArithmeticTask(seed=0)
        problem = make_problem(0, [3, 1, 4])    # prompt "a3b1c4=", solution "a3:03,b1:04,c4:08#8"
        task.reward(problem, "a3:03,b1:04,c4:08#8")  # 1.0
        task.reward(problem, "a3:03,b1:04,c4:07#7")  # 1/3: complete chain, 2 of 3 steps right, wrong answer
        task.reward(problem, "a3:03,b2:05,c4:09#9")  # 1/6: a misread term, 1 of 3 steps right

    Reward (see `reward`): 1.0 when the response (decoded without special tokens, surrounding
    whitespace ignored) has one well-formed step per term, each restating its term, then exactly
    one answer marker `#` and after it exactly the answer digit; any other complete chain gets
    partial credit for its right steps; anything malformed (a skipped step, no marker, several
    markers, text after the answer) gets 0.0.
    """

    name = "arithmetic"
    options = (
        TaskOption("max_terms", int, 48, minimum=1, maximum=len(LABELS)),
        TaskOption("tail_exponent", float, 1.5, minimum=0.0),
        TaskOption("min_terms", int, 1, minimum=1),
    )

    def __init__(self, seed: int, max_terms: int = 48, tail_exponent: float = 1.5, min_terms: int = 1) -> None:
        check_option_values(self.options, max_terms=max_terms, tail_exponent=tail_exponent, min_terms=min_terms)
        if min_terms > max_terms:
            raise TaskOptionError(
                f"task.options.min_terms ({min_terms}) must not exceed task.options.max_terms ({max_terms})."
            )
        self.seed = seed
        self.min_terms = min_terms
        self.max_terms = max_terms
        self.tail_exponent = tail_exponent
        self._term_counts = StratifiedPowerLaw(min_terms, max_terms, tail_exponent, seed)
        # characters in the longest reference solution (EOS not counted): a budget for max_new_tokens
        self.max_solution_length = len(make_problem(0, [9] * max_terms).solution)

    def problem(self, index: int) -> Problem:
        """The problem at `index`: digits from a generator seeded by (seed, index).

        The term count is stratified rather than drawn independently (tlt_cli/tasks/tail.py): any
        run of consecutive indices, such as one RL step's prompts, covers the long tail evenly.
        Step-to-step reward then reflects the policy, not the luck of the mix.
        """
        rng = np.random.default_rng([self.seed, index])
        digits = [int(digit) for digit in rng.integers(0, 10, size=self._term_counts.count(index))]
        return make_problem(index, digits)

    def reward(self, problem: Problem, response: str) -> float:
        """1.0 for a right chain with the right answer; partial credit for right steps of a complete chain.

        A complete chain has one step per term, each with its term's label, a digit, and a
        two-digit total, then a single answer marker and one answer digit; anything else scores 0,
        so guessing long problems' answers without working them out never pays (which would also
        erase the long tail of response lengths the task exists to produce). It scores 1.0 when
        every term is restated right and the answer is right; otherwise 0.5 x the fraction of its
        steps equal to the reference's. A misread term is an error in a complete chain, not a
        malformed one, so samples of a long problem that go wrong at different steps differ in
        reward and GRPO has a signal on problems the policy does not solve yet.
        """
        chain, marker, final = response.strip().partition(ANSWER_MARKER)
        answer_is_one_digit = len(final) == 1 and final.isdigit()
        terms = _terms(problem.prompt)
        steps = chain.split(STEP_SEPARATOR)
        if not marker or not answer_is_one_digit or not _chain_is_complete(terms, steps):
            return 0.0
        if final == problem.answer and all(step[:2] == term for step, term in zip(steps, terms)):
            return 1.0
        reference = problem.solution.partition(ANSWER_MARKER)[0].split(STEP_SEPARATOR)
        right_steps = sum(step == expected for step, expected in zip(steps, reference))
        return PARTIAL_CREDIT * right_steps / len(reference)


def _terms(prompt: str) -> list[str]:
    """The prompt's labelled terms, e.g. ["a3", "b1"] for "a3b1="."""
    return [prompt[position : position + 2] for position in range(0, len(prompt) - 1, 2)]


def _chain_is_complete(terms: list[str], steps: list[str]) -> bool:
    """One step "<label><digit>:<two digits>" per term, in order, each with its term's label."""
    return len(steps) == len(terms) and all(
        len(step) == 5 and step[0] == term[0] and step[1].isdigit() and step[2] == SUM_SEPARATOR and step[3:].isdigit()
        for step, term in zip(steps, terms)
    )


def make_problem(index: int, digits: list[int]) -> Problem:
    """The problem for an explicit digit list, with its reference solution."""
    prompt = "".join(f"{label}{digit}" for label, digit in zip(LABELS, digits)) + QUESTION_END
    solution = worked_solution(digits, step_totals(digits))
    return Problem(index=index, prompt=prompt, answer=solution.partition(ANSWER_MARKER)[2], solution=solution)


def prompt_digits(prompt: str) -> list[int]:
    """The digits of a problem's prompt, in order: [3, 1] for "a3b1="."""
    return [int(term[1]) for term in _terms(prompt)]


def step_totals(digits: list[int], as_written: Callable[[int], int] = lambda total: total) -> list[int]:
    """The total of every step: t_k = s_{k-1} + d_k in 0..18, where s_k = t_k mod 10 and s_0 = 0.

    as_written(t) is the total a solver writes down instead of t (the tiny model's warm-up
    passes slips); its ones digit is the running sum the next step adds to.
    """
    totals = []
    running_sum = 0
    for digit in digits:
        totals.append(as_written(running_sum + digit))
        running_sum = totals[-1] % 10
    return totals


def worked_solution(digits: list[int], totals: list[int]) -> str:
    """The chain for `digits` with the given step totals, then the marker and the last total's ones digit.

    With `step_totals(digits)` this is the reference solution; any other totals are written as
    given (the tiny model's warm-up passes totals with slips that carry forward).
    """
    steps = [f"{label}{digit}{SUM_SEPARATOR}{total:02d}" for label, digit, total in zip(LABELS, digits, totals)]
    return STEP_SEPARATOR.join(steps) + ANSWER_MARKER + str(totals[-1] % 10)
