"""The math task's parts that stand alone: the rule verifier (rlhf.rewards.rule) on tricky outputs, the problem
generator (rlhf.data.math) checked against an independent solver, and the schema that refuses bad answers."""

from __future__ import annotations

import re
from decimal import Decimal

import pandas as pd
import pytest

from rlhf.data.math import problems
from rlhf.data.schemas import DataError, MathProblems, validate
from rlhf.rewards.rule import final_answer, parse_answer, rule_score

# (response, its final number, stated after "answer")
CASES = [
    ("The answer is 42 apples.", "42", True),
    ("Answer: -7", "-7", True),
    ("So the answer is 12 + 30 = 42", "42", True),  # an equation after the marker: its result
    ("12 + 30 = 42", "42", False),
    ("12 + 30 = 42, then 42 - 2 = 40", "40", False),  # the last "=" wins
    ("First 12, then 30 more: 42", "42", False),  # several numbers, no marker: the last
    ("It costs $1,250 in total", "1250", False),  # thousands commas
    ("12,000,000 people", "12000000", False),
    ("values 3,4", "4", False),  # not a thousands group: two numbers
    ("The answer is 1,2345", "1", True),  # "1,2345" is 1 then 2345: the first after the marker
    ("answer: \u22125 degrees", "-5", True),  # Unicode minus
    ("It weighs 42kg.", "42", False),  # units, a full stop
    ("x = 42.0", "42.0", False),
    ("the ANSWER is 8. Earlier I said 3 and 5.", "8", True),  # the marker decides, not the last number
]


@pytest.mark.parametrize("response, number, stated", CASES)
def test_the_verifier_reads_the_final_answer_by_its_rules(response, number, stated):
    assert final_answer(response) == (Decimal(number), stated)


@pytest.mark.parametrize("response", ["", "   ", "no number here", "The answer is unknown.", "=", "12 = 4 answer"])
def test_a_response_without_a_final_number_scores_zero_and_never_raises(response):
    assert final_answer(response)[0] is None
    assert rule_score(response, "4") == 0.0


def test_the_score_is_exact_match_plus_an_optional_format_bonus():
    assert rule_score("The answer is 42.", "42") == 1.0
    assert rule_score("x = 42.0", "42") == 1.0  # equal as numbers
    assert rule_score("41.99", "42") == 0.0
    assert rule_score("The answer is 42.", "42", format_bonus=0.1) == pytest.approx(1.1)
    assert rule_score("The answer is 41.", "42", format_bonus=0.1) == pytest.approx(0.1)  # the form, not the value
    assert rule_score("42", "42", format_bonus=0.1) == 1.0
    assert rule_score("-5", "-5") == 1.0
    with pytest.raises(ValueError, match="answer 'forty' is not a number"):
        parse_answer("forty")


def _solve(prompt: str) -> int:
    """The answer read back from the problem's text, independently of the generator's own arithmetic."""
    n = [int(x) for x in re.findall(r"\d+", prompt)]
    patterns = [
        (r"has \d+ \w+\. \w+ gets \d+ more\.", lambda: n[0] + n[1]),
        (r"had \d+ \w+ and gave away \d+\.", lambda: n[0] - n[1]),
        (r"fills \d+ boxes with \d+ \w+ each\.", lambda: n[0] * n[1]),
        (r"shares \d+ \w+ equally among \d+ friends\.", lambda: n[0] // n[1]),
        (r"it was \d+ degrees\. By night it fell by \d+", lambda: n[0] - n[1]),
    ]
    value = next(f() for pattern, f in patterns if re.search(pattern, prompt))
    if then := re.search(r"Then \w+ (buys|loses) (\d+)\.", prompt):
        value += int(then.group(2)) * (1 if then.group(1) == "buys" else -1)
    return value


def test_generated_problems_are_reproducible_distinct_and_correct():
    df = problems(600, seed=7)
    validate(df, MathProblems, "generated problems")
    pd.testing.assert_frame_equal(df, problems(600, seed=7))  # the seed decides everything
    assert not df["prompt"].equals(problems(600, seed=8)["prompt"])
    assert df["prompt"].is_unique and df["difficulty"].value_counts().to_dict() == {1: 200, 2: 200, 3: 200}
    assert [_solve(p) for p in df["prompt"]] == df["answer"].astype(int).tolist()
    divisions = df[df["prompt"].str.contains("equally")]
    assert len(divisions) > 10  # exact: the solver's integer division gave the stated answer for each
    negative = df[df["answer"].astype(int) < 0]
    assert len(negative) > 5 and negative["prompt"].str.contains("degrees").all()  # only temperatures go below 0


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda df: df.drop(columns="answer"), "missing column: answer"),
        (lambda df: df.assign(answer=["forty"] + df["answer"].tolist()[1:]), "column 'answer': str_matches"),
        (lambda df: df.assign(answer=["4 apples"] + df["answer"].tolist()[1:]), "column 'answer': str_matches"),
        (lambda df: df.assign(answer=[None] + df["answer"].tolist()[1:]), "column 'answer'"),
        (lambda df: df.assign(difficulty=[4] + df["difficulty"].tolist()[1:]), "column 'difficulty': isin"),
    ],
)
def test_the_schema_refuses_a_problem_whose_answer_is_missing_or_not_a_number(change, message):
    with pytest.raises(DataError, match=re.escape(message)):
        validate(change(problems(6, seed=1)), MathProblems, "problems.csv")
