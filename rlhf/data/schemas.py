"""Every table schema of the project (pandera), and `validate`, the one way a stage checks a frame.

Each schema is strict (no extra or missing columns), non-null, and typed exactly (no coercion: a
prompt_id stored as float is a bug upstream, not something to paper over). Strings must contain a
non-space character. Scores from the gold judge are probabilities in [0, 1].

Tables and who writes them:
    RawReviews      reviews CSV after cleaning                         rlhf.data.reviews
    Prompts         reward_prompts / rl_prompts splits                 stage prepare
    EvalPrompts     eval_prompts split (prompt + real continuation)    stage prepare
    SFTExamples     sft split (plain texts)                            stage prepare
    SFTPairs        sft split (prompt + completion, math task)         stage prepare
    LabelledTexts   gold_train / gold_test splits (human labels)       stage prepare
    PreferencePairs sampled pairs labelled by the gold judge           stage reward
    Generations     policy samples on eval prompts                     stage generate
    EvalResults     gold / proxy / KL per evaluated sample             stage evaluate
    MathProblems    arithmetic word problems with their answers        rlhf.data.math (stage prepare)
    MathResults     accuracy / pass@k / KL per evaluated problem       stage evaluate (math task)
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pandera.pandas as pa
from pandera.typing import Series

_NON_BLANK = r"\s*\S"  # re.match: some non-space character somewhere


class DataError(ValueError):
    """Input data is missing, unreadable or does not match its schema; the message names the file/split."""


class _Strict(pa.DataFrameModel):
    class Config:
        strict = True
        coerce = False


def _text():
    return pa.Field(str_matches=_NON_BLANK)


def _probability():
    return pa.Field(ge=0.0, le=1.0)


def _finite():
    # strict bounds at +-inf reject +-inf; NaN is already rejected as a null
    return pa.Field(in_range={"min_value": -np.inf, "max_value": np.inf, "include_min": False, "include_max": False})


class RawReviews(_Strict):
    """One labelled review: label 1 = positive, 0 = negative; source e.g. imdb / rotten_tomatoes."""

    text: Series[str] = _text()
    label: Series[int] = pa.Field(isin=[0, 1])
    source: Series[str] = _text()


class Prompts(_Strict):
    """A prompt for sampling; prompt_id is unique across all splits of one prepared dataset."""

    prompt_id: Series[int] = pa.Field(unique=True, ge=0)
    prompt: Series[str] = _text()


class EvalPrompts(_Strict):
    """A held-out prompt and the real continuation that followed it (the reference)."""

    prompt_id: Series[int] = pa.Field(unique=True, ge=0)
    prompt: Series[str] = _text()
    reference: Series[str] = _text()


class SFTExamples(_Strict):
    """A text for causal-LM fine-tuning of the policy."""

    text: Series[str] = _text()


class SFTPairs(_Strict):
    """A prompt and the completion the policy should give: SFT learns the completion's tokens only, with the prompt
    encoded as every stage encodes prompts (in the model's chat template when data.chat_template uses it)."""

    prompt: Series[str] = _text()
    completion: Series[str] = _text()


class LabelledTexts(_Strict):
    """A human-labelled text the gold judge is fitted / measured on (label 1 = positive / preferred)."""

    text: Series[str] = _text()
    label: Series[int] = pa.Field(isin=[0, 1])
    source: Series[str] = _text()


class PreferencePairs(_Strict):
    """Two responses to one prompt, ordered by the gold judge (chosen_gold >= rejected_gold)."""

    prompt: Series[str] = _text()
    # responses may be empty: a policy can emit EOS at once, and that is a real (usually bad) sample
    chosen: Series[str] = pa.Field()
    rejected: Series[str] = pa.Field()
    chosen_gold: Series[float] = _probability()
    rejected_gold: Series[float] = _probability()


class Generations(_Strict):
    """One sampled response; model names the policy that wrote it (e.g. sft, online_dpo)."""

    prompt_id: Series[int] = pa.Field(ge=0)
    prompt: Series[str] = _text()
    response: Series[str] = pa.Field()  # may be empty or blank: a policy can emit EOS at once
    model: Series[str] = _text()


class EvalResults(_Strict):
    """Scores of one generation: gold judge P(positive), proxy RM score, KL to the SFT policy (nats)."""

    prompt_id: Series[int] = pa.Field(ge=0)
    model: Series[str] = _text()
    gold: Series[float] = _probability()
    proxy: Series[float] = _finite()
    kl: Series[float] = _finite()


class MathProblems(_Strict):
    """A word problem and its answer: a decimal number as text (rlhf.rewards.rule reads it), difficulty 1-3."""

    prompt_id: Series[int] = pa.Field(unique=True, ge=0)
    prompt: Series[str] = _text()
    answer: Series[str] = pa.Field(str_matches=r"^-?\d+(\.\d+)?$")
    difficulty: Series[int] = pa.Field(isin=[1, 2, 3])


class MathResults(_Strict):
    """One held-out problem for one policy: its near-greedy answer is correct (1/0), the fraction of its eval.pass_k
    samples (train.temperature) that are, and the KL of the first of them to the SFT policy (nats)."""

    prompt_id: Series[int] = pa.Field(ge=0)
    model: Series[str] = _text()
    correct: Series[int] = pa.Field(isin=[0, 1])
    samples_correct: Series[float] = _probability()
    kl: Series[float] = _finite()


def _summary(err: pa.errors.SchemaErrors) -> str:
    """One line per (column, check) with a few failing values, e.g. `label: isin([0, 1]) failed 3x (e.g. 2)`."""
    cases = err.failure_cases
    lines = []
    for (column, check), group in cases.groupby(["column", "check"], dropna=False, sort=False):
        values = [repr(v) for v in group["failure_case"].head(3)]
        if check in ("column_in_dataframe", "column_in_schema"):
            what = "missing column" if check == "column_in_dataframe" else "unexpected column"
            lines.append(f"{what}: {', '.join(v.strip(chr(39)) for v in values)}")
        else:
            lines.append(f"column {column!r}: {check} failed for {len(group)} row(s) (e.g. {', '.join(values)})")
    return "\n  ".join(lines)


def validate(df: pd.DataFrame, schema: type[pa.DataFrameModel], what: str) -> pd.DataFrame:
    """Check `df` against `schema`; return it unchanged, or raise DataError naming `what` and the columns.

    `what` says where the frame came from, e.g. "split 'rl_prompts' in data/prepared" or a CSV path.
    An empty frame is an error too: every table of the pipeline must have rows.
    """
    if len(df) == 0:
        raise DataError(f"{what} is empty (0 rows; schema {schema.__name__})")
    try:
        out = schema.validate(df, lazy=True)
    except pa.errors.SchemaErrors as e:
        raise DataError(f"{what} does not match schema {schema.__name__}:\n  {_summary(e)}") from None
    except pa.errors.SchemaError as e:  # raised instead of SchemaErrors for some frame-level problems
        raise DataError(f"{what} does not match schema {schema.__name__}: {e}") from None
    return out
