"""Arithmetic word questions in plain English, worked step by step and rewarded on the final number: a
task for pretrained instruct models, which answer in prose.

A problem is a short story about one person counting one kind of thing: a starting amount, then
1..max_steps events, each adding or taking away some (or adding a few bags of a few each), then
the question how many they have now. For example (two steps):
    "Mia has 7 apples. She buys 5 more. Then she gives 3 to a friend. How many apples does Mia
    have now?"  (answer "9")
The prompt asks for the work step by step, one line per event, and shows one worked example
before the story (INSTRUCTION); the reference solution has that form ("7 + 5 = 12", "12 - 3 = 9",
"The answer is 9."). The number of events is drawn from P(n) ~ n^-tail_exponent on 1..max_steps
(0: uniform), stratified across indices (tlt_cli/tasks/tail.py): most stories are short and a few
long, so response lengths have the long tail RL on reasoning has. Amounts stay in 1..max_number
per event and never go below zero. Problems are generated from a generator seeded by (seed,
index), so the set is unbounded and the same index always gives the same problem. The reward is
that of jsonl_math: 1.0 when the last number in the response equals the answer, else 0.0, so a
model may work the sum out in prose first. A small model gets one step right often and more steps
less often, so rewards within a GRPO group vary.
"""

from __future__ import annotations

import numpy as np

from tlt_cli.tasks.base import Problem, TaskOption, check_option_values
from tlt_cli.tasks.jsonl_math import last_number_reward
from tlt_cli.tasks.tail import StratifiedPowerLaw

# (name, subject pronoun, object pronoun)
PEOPLE = (
    ("Mia", "She", "her"),
    ("Tom", "He", "him"),
    ("Sara", "She", "her"),
    ("Ben", "He", "him"),
    ("Lena", "She", "her"),
    ("Omar", "He", "him"),
    ("Ava", "She", "her"),
    ("Leo", "He", "him"),
)
THINGS = ("apples", "pencils", "stickers", "marbles", "cookies", "books", "coins", "shells")
# an event that adds b: format fields subject, object, b
ADDITIONS = ("{subject} buys {b} more.", "{subject} finds {b} more.", "A friend gives {object} {b} more.")
# an event that takes b away
SUBTRACTIONS = ("{subject} gives {b} to a friend.", "{subject} loses {b}.", "{subject} uses {b}.")
# an event that adds b x c
BAGS = "{subject} buys {b} bags with {c} {things} in each."
# what the prompt asks for before the story: step-by-step work, shown by one worked example
INSTRUCTION = (
    "Solve the problem step by step, one line per event, then give the answer, as in this example.\n"
    "Problem: Tom has 4 coins. He finds 3 more. Then he loses 2. How many coins does Tom have now?\n"
    "Solution:\n4 + 3 = 7\n7 - 2 = 5\nThe answer is 5.\n\nProblem: "
)
# most events a story can have
MAX_STEPS = 48


class WordArithmeticTask:
    """Plain-English counting stories with 1..max_steps events; see the module docstring.

    Example:
        task = WordArithmeticTask(seed=0)
        problem = task.problem(0)
        task.reward(problem, f"So the answer is {problem.answer}.")  # 1.0
    """

    name = "word_arithmetic"
    options = (
        TaskOption("max_steps", int, 2, minimum=1, maximum=MAX_STEPS),
        TaskOption("max_number", int, 20, minimum=2, maximum=1000),
        TaskOption("tail_exponent", float, 0.0, minimum=0.0),
    )

    def __init__(self, seed: int, max_steps: int = 2, max_number: int = 20, tail_exponent: float = 0.0) -> None:
        check_option_values(self.options, max_steps=max_steps, max_number=max_number, tail_exponent=tail_exponent)
        self.seed = seed
        self.max_steps = max_steps
        self.max_number = max_number
        self.tail_exponent = tail_exponent
        self._event_counts = StratifiedPowerLaw(1, max_steps, tail_exponent, seed)

    def problem(self, index: int) -> Problem:
        """The story at `index`: its person, thing, amounts and events drawn from (seed, index)."""
        rng = np.random.default_rng([self.seed, index])
        name, subject, object_pronoun = PEOPLE[int(rng.integers(len(PEOPLE)))]
        things = THINGS[int(rng.integers(len(THINGS)))]
        count = int(rng.integers(1, self.max_number + 1))
        sentences = [f"{name} has {count} {things}."]
        working = []
        for step in range(self._event_counts.count(index)):
            sentence, count, worked = self._event(rng, count, subject, object_pronoun, things)
            sentences.append(sentence if step == 0 else f"Then {sentence[0].lower()}{sentence[1:]}")
            working.append(worked)
        sentences.append(f"How many {things} does {name} have now?")
        solution = "\n".join([*working, f"The answer is {count}."])
        return Problem(index=index, prompt=INSTRUCTION + " ".join(sentences), answer=str(count), solution=solution)

    def _event(
        self, rng: np.random.Generator, count: int, subject: str, object_pronoun: str, things: str
    ) -> tuple[str, int, str]:
        """(sentence, new count, worked step) of one event; it takes away only what there is."""
        b = int(rng.integers(1, self.max_number + 1))
        kind = int(rng.integers(3))
        if kind == 1 and count > 0:
            b = min(b, count)
            sentence = SUBTRACTIONS[int(rng.integers(len(SUBTRACTIONS)))]
            return sentence.format(subject=subject, b=b), count - b, f"{count} - {b} = {count - b}"
        if kind == 2:
            b, c = int(rng.integers(2, 6)), int(rng.integers(2, 11))
            sentence = BAGS.format(subject=subject, b=b, c=c, things=things)
            return sentence, count + b * c, f"{b} x {c} = {b * c}, and {count} + {b * c} = {count + b * c}"
        sentence = ADDITIONS[int(rng.integers(len(ADDITIONS)))]
        return sentence.format(subject=subject, object=object_pronoun, b=b), count + b, f"{count} + {b} = {count + b}"

    def reward(self, problem: Problem, response: str) -> float:
        """1.0 iff the response's last number equals the answer, else 0.0."""
        return last_number_reward(response, problem.answer)
