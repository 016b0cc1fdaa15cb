"""The rule reward of the math task: read the final number of a response and compare it with the answer.

Rules, in order (`final_answer`):
1. Digits grouped by commas are one number ("1,250" is 1250); a comma not followed by exactly three digits
   separates ("3,4" is 3 then 4). A Unicode minus counts as "-".
2. If the response says "answer" (any case), only what follows its last "answer" counts, and in it the first
   number after the last "=" if there is one ("So the answer is 12 + 30 = 42" -> 42), else the first number
   ("The answer is 42 apples." -> 42, "Answer: -7" -> -7).
3. Else, if it has "=", the first number after the last "=" ("12 + 30 = 42" -> 42).
4. Else its last number ("First 12, then 30 more: 42" -> 42).
5. No number: no answer; the response scores 0, never an error.
A number is an optional "-", digits, an optional "." and digits; "$42", "42kg" and "42." all read as 42. The final
number is correct when it equals the answer as a decimal ("42.0" is 42, "41.99" is not).

score = 1 if correct else 0, plus `format_bonus` when the response states its answer as "answer" + number
(rule 2): a small push toward a checkable form, off by default.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

RULE_JUDGE = {"judge": "rule", "verifier": "rlhf.rewards.rule.rule_score"}  # data/gold/rule.json of the math task
_GROUPED = re.compile(r"(?<![\d.])(\d{1,3}(?:,\d{3})+)(?![\d,])")  # 1,250 / 12,000,000 (not 3,4 nor 1,2345)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_ANSWER = re.compile(r"answer", re.IGNORECASE)


def _normalise(text: str) -> str:
    text = text.replace("\u2212", "-")  # Unicode minus
    return _GROUPED.sub(lambda m: m.group(1).replace(",", ""), text)


def final_answer(response: str) -> tuple[Decimal | None, bool]:
    """(the response's final number or None, whether it came after an "answer" marker)."""
    text = _normalise(response)
    markers = list(_ANSWER.finditer(text))
    stated = bool(markers)
    if stated:
        text = text[markers[-1].end() :]
    if "=" in text and (after := _NUMBER.search(text, text.rindex("=") + 1)):
        return Decimal(after.group()), stated
    numbers = _NUMBER.findall(text)
    if not numbers:
        return None, False
    return Decimal(numbers[0] if stated else numbers[-1]), stated


def parse_answer(answer: str) -> Decimal:
    """A problem's answer field as a number; ValueError naming it when it is not one."""
    try:
        value = Decimal(answer.strip())
    except (InvalidOperation, AttributeError):
        raise ValueError(f"answer {answer!r} is not a number") from None
    if not value.is_finite():
        raise ValueError(f"answer {answer!r} is not a finite number")
    return value


def rule_score(response: str, answer: str, format_bonus: float = 0.0) -> float:
    """1.0 when the response's final number equals `answer`, else 0.0; + format_bonus if stated as an answer."""
    value, stated = final_answer(response)
    correct = value is not None and value == parse_answer(answer)
    return float(correct) + (format_bonus if stated else 0.0)
