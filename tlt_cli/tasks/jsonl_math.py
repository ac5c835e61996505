"""Math word problems from a GSM8K-style JSONL file, rewarded on the final number.

Each line is `{"question": "...", "answer": "... #### 42"}`. The prompt is the question in
a fixed template; the reward is 1.0 when the last number in the response equals the
answer's final number (the number after the last `####`, else the answer's last number),
compared numerically with thousands separators removed. A malformed file raises
`TaskDataError` naming the file and line when the task is built, not mid-run.
Indexes wrap around: index i reads epoch i // N, position i % N of a permutation of the
file's N problems seeded by (seed, epoch), so every epoch visits every problem once.
"""

from __future__ import annotations

import json
import re
from decimal import Decimal
from pathlib import Path

import numpy as np

from tlt_cli.atomic_files import not_a_file
from tlt_cli.errors import UserError
from tlt_cli.tasks.base import Problem, TaskOption

PROMPT_TEMPLATE = "Question: {question}\nAnswer: Let's think step by step.\n"
FINAL_ANSWER_MARKER = "####"
# an optionally signed number with optional thousands separators and decimals: -1,234.5
NUMBER_PATTERN = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


class TaskDataError(UserError):
    """A task's data file cannot be used; the message names the file and the line."""


class JsonlMathTask:
    """GSM8K-style problems read from `path`; see the module docstring for the reward.

    Example:
        task = JsonlMathTask("gsm8k_train.jsonl", seed=0)
        problem = task.problem(0)
        task.reward(problem, "... so she has 42 apples.")  # 1.0 if the answer is 42
    """

    name = "jsonl_math"
    options = (TaskOption("path", str),)

    def __init__(self, path: str | Path, seed: int) -> None:
        self.path = Path(path)
        self.seed = seed
        self._records = read_records(self.path)

    def __len__(self) -> int:
        return len(self._records)

    def problem(self, index: int) -> Problem:
        """The problem at `index`: position index % N of epoch index // N's permutation."""
        epoch, position = divmod(index, len(self._records))
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self._records))
        question, solution, answer = self._records[int(order[position])]
        return Problem(index=index, prompt=PROMPT_TEMPLATE.format(question=question), answer=answer, solution=solution)

    def reward(self, problem: Problem, response: str) -> float:
        """1.0 iff the response's last number equals the answer numerically, else 0.0."""
        return last_number_reward(response, problem.answer)


def last_number_reward(response: str, answer: str) -> float:
    """1.0 iff the last number in `response` equals `answer` numerically (commas ignored), else 0.0."""
    numbers = NUMBER_PATTERN.findall(response)
    if not numbers:
        return 0.0
    return 1.0 if parse_number(numbers[-1]) == parse_number(answer) else 0.0


def read_records(path: Path) -> list[tuple[str, str, str]]:
    """(question, answer text, final number) for every non-blank line of `path`."""
    if not path.is_file():
        raise TaskDataError(
            f"task.options.path: the data file {path} {not_a_file(path)}; give the path of a JSONL file."
        )
    records = []
    with path.open("rb") as lines:
        for line_number, raw_line in enumerate(lines, start=1):
            try:
                line = raw_line.decode("utf-8")
            except UnicodeDecodeError:
                raise TaskDataError(f"{path}, line {line_number} is not UTF-8 text.") from None
            if line.strip():
                records.append(_parse_line(path, line_number, line))
    if not records:
        raise TaskDataError(f"Task data file {path} is empty (line 1): it needs one JSON object per line.")
    return records


def _parse_line(path: Path, line_number: int, line: str) -> tuple[str, str, str]:
    where = f"{path}, line {line_number}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise TaskDataError(f"{where} is not valid JSON ({error.msg}).") from None
    if not isinstance(record, dict):
        raise TaskDataError(f"{where} must be a JSON object with 'question' and 'answer' keys.")
    for key in ("question", "answer"):
        if not isinstance(record.get(key), str):
            raise TaskDataError(f"{where} is missing the string key '{key}'.")
    final_number = final_answer_number(record["answer"])
    if final_number is None:
        raise TaskDataError(f"{where} has an answer without a final number (expected '... #### 42').")
    return record["question"], record["answer"], final_number


def final_answer_number(answer: str) -> str | None:
    """The number after the last '####' (else the last number of `answer`), commas removed."""
    _, marker, after_marker = answer.rpartition(FINAL_ANSWER_MARKER)
    numbers = NUMBER_PATTERN.findall(after_marker if marker else answer)
    if not numbers:
        return None
    return numbers[0 if marker else -1].replace(",", "")


def parse_number(text: str) -> Decimal:
    """A NUMBER_PATTERN match as an exact decimal, thousands separators removed."""
    return Decimal(text.replace(",", ""))
