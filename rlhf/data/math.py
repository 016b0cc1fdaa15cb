"""Arithmetic word problems made from the seed (no download): the math task's problems, each with its answer.

A problem is a template (a story with an operation) filled with a name, an object and numbers drawn by a numpy
Generator; `difficulty` 1-3 sets how many steps it takes and how large the numbers are:
    1  one addition or subtraction, numbers up to 20
    2  one step of any of + - x / (division always exact), numbers up to 50
    3  two steps (a second operation on the first result), numbers up to 100; the temperature story can go below 0
Answers are integers, written as decimal strings (the verifier, rlhf.rewards.rule, reads them back). The same
seed gives the same problems, in the same order, on every machine.

`build_splits` makes the task's splits for stage prepare: distinct problems cut into sft (prompt + the completion
"The answer is N."), rl_prompts and eval_prompts (question + INSTRUCTION, with answer and difficulty), disjoint.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Hugo", "Ines", "Jonas", "Kemi", "Leo", "Mara", "Noor", "Omar")
OBJECTS = ("apples", "marbles", "stickers", "books", "coins", "pencils", "shells", "cards", "eggs", "stamps")
LIMITS = {1: 20, 2: 50, 3: 100}  # the largest number drawn, by difficulty
INSTRUCTION = "End with 'The answer is N.'"  # after each question: a checkable last line (rlhf.rewards.rule)


# Each story: (rng, largest number, name, object) -> (facts, question, answer).


def _add(rng, n, who, what):
    a, b = rng.integers(1, n + 1, size=2)
    return f"{who} has {a} {what}. {who} gets {b} more.", f"How many {what} does {who} have now?", a + b


def _subtract(rng, n, who, what):
    a = rng.integers(2, n + 1)
    b = rng.integers(1, a)
    return f"{who} had {a} {what} and gave away {b}.", f"How many {what} does {who} have left?", a - b


def _multiply(rng, n, who, what):
    a, b = rng.integers(2, max(3, int(n**0.5) + 3), size=2)
    return f"{who} fills {a} boxes with {b} {what} each.", f"How many {what} are in the boxes?", a * b


def _divide(rng, n, who, what):
    each, groups = rng.integers(2, max(3, int(n**0.5) + 3), size=2)
    facts = f"{who} shares {each * groups} {what} equally among {groups} friends."
    return facts, f"How many {what} does each friend get?", each


def _two_steps(rng, n, who, what):
    facts, _, value = (_add, _subtract, _multiply)[rng.integers(3)](rng, n, who, what)
    more = rng.integers(2) == 1
    c = rng.integers(1, n // 4 + 2 if more else min(n // 4 + 2, value + 1))  # nobody loses more than they have
    then = f"Then {who} {'buys' if more else 'loses'} {c}."
    return f"{facts} {then}", f"How many {what} does {who} have in the end?", value + c if more else value - c


def _temperature(rng, n, who, what):
    start, drop = rng.integers(0, 15), rng.integers(5, 30)
    facts = f"In the morning it was {start} degrees. By night it fell by {drop} degrees."
    return facts, "What was the temperature at night?", start - drop


# Difficulty 3: two steps twice as often as the temperature story (the one with answers below 0).
STORIES = {1: (_add, _subtract), 2: (_add, _subtract, _multiply, _divide), 3: (_two_steps, _two_steps, _temperature)}


def problem(rng: np.random.Generator, difficulty: int) -> tuple[str, str]:
    """(question, answer) of one problem at `difficulty` (1-3)."""
    if difficulty not in STORIES:
        raise ValueError(f"difficulty must be 1, 2 or 3, got {difficulty}")
    stories = STORIES[difficulty]
    story = stories[rng.integers(len(stories))]
    who, what = NAMES[rng.integers(len(NAMES))], OBJECTS[rng.integers(len(OBJECTS))]
    facts, question, answer = story(rng, LIMITS[difficulty], who, what)
    return f"{facts} {question}", str(int(answer))


def problems(n: int, seed: int, difficulties: tuple[int, ...] = (1, 2, 3)) -> pd.DataFrame:
    """n distinct problems (prompt_id, prompt, answer, difficulty), difficulties in turn, from `seed`."""
    rng = np.random.default_rng(seed)
    rows, seen = [], set()
    for _ in range(50 * n):  # far more draws than n distinct problems need at these sizes
        if len(rows) == n:
            break
        difficulty = difficulties[len(rows) % len(difficulties)]
        question, answer = problem(rng, difficulty)
        if question not in seen:
            seen.add(question)
            rows.append((len(rows), question, answer, difficulty))
    if len(rows) < n:
        raise ValueError(f"only {len(rows)} distinct problems at difficulties {difficulties}, {n} asked for")
    return pd.DataFrame(rows, columns=["prompt_id", "prompt", "answer", "difficulty"])


def build_splits(data, seed: int) -> dict[str, pd.DataFrame]:
    """The math task's splits from data.n_sft / n_rl_prompts / n_eval_prompts distinct problems (disjoint)."""
    sizes = {"sft": data.n_sft, "rl_prompts": data.n_rl_prompts, "eval_prompts": data.n_eval_prompts}
    df = problems(sum(sizes.values()), seed)
    df["prompt"] = df["prompt"] + " " + INSTRUCTION
    splits, start = {}, 0
    for name, n in sizes.items():
        splits[name] = df.iloc[start : start + n].reset_index(drop=True)
        start += n
    sft = splits.pop("sft")
    splits["sft"] = pd.DataFrame({"prompt": sft["prompt"], "completion": answer_lines(sft["answer"])})
    return splits


def answer_lines(answers: pd.Series) -> pd.Series:
    """Each answer as the instruction asks for it: the SFT completions."""
    return "The answer is " + answers + "."


def worked(prompts: pd.Series, answers: pd.Series) -> pd.Series:
    """Each prompt followed by its answer line, as plain text."""
    return prompts + " " + answer_lines(answers)
