"""The prepared dataset on disk: one HF `datasets` DatasetDict folder, written atomically and reproducibly.

Split names and their schemas (the contract between `prepare` and every later stage), for the reviews and tldr
tasks:
    sft            SFTExamples     texts for causal-LM fine-tuning
    reward_prompts Prompts         prompts whose sampled pairs train the proxy reward model
    rl_prompts     Prompts         prompts for online RL
    eval_prompts   EvalPrompts     held-out prompts + real continuations
    gold_train     LabelledTexts   human labels the gold judge is fitted on
    gold_test      LabelledTexts   held-out human labels (disjoint texts) to measure the judge
The math task (data.source: math) has sft as SFTPairs (prompt + completion), and rl_prompts / eval_prompts as
MathProblems (prompt + answer): its judge is the rule verifier, so it has no labelled texts, and no reward_prompts
(it trains no reward model).

Re-running `prepare` with the same inputs gives byte-identical files, so DVC sees no change: `datasets`
normally stores a random fingerprint in state.json; here the fingerprint is a hash of the table content.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pandas as pd
import pandera.pandas as pa
import pyarrow as pa_arrow

from rlhf.config import ConfigError
from rlhf.data.schemas import (
    DataError,
    EvalPrompts,
    LabelledTexts,
    MathProblems,
    Prompts,
    SFTExamples,
    SFTPairs,
    validate,
)
from rlhf.io import atomic_dir

SPLIT_SCHEMAS: dict[str, type[pa.DataFrameModel]] = {
    "sft": SFTExamples,
    "reward_prompts": Prompts,
    "rl_prompts": Prompts,
    "eval_prompts": EvalPrompts,
    "gold_train": LabelledTexts,
    "gold_test": LabelledTexts,
}
MATH_SPLIT_SCHEMAS: dict[str, type[pa.DataFrameModel]] = {
    "sft": SFTPairs,
    "rl_prompts": MathProblems,
    "eval_prompts": MathProblems,
}
_HINT = "run `rlhf prepare` first"


def split_schemas(source: str) -> dict[str, type[pa.DataFrameModel]]:
    """The splits of data.source's task and their schemas."""
    return MATH_SPLIT_SCHEMAS if source == "math" else SPLIT_SCHEMAS


def load_task_split(folder: Path | str, name: str, source: str) -> pd.DataFrame:
    """One split of data.source's task, validated against that task's schema for it."""
    return load_split(folder, name, split_schemas(source)[name])


def take_rows(order: np.ndarray, start: int, n: int, field: str, what: str) -> np.ndarray:
    """order[start:start+n], or a ConfigError naming data.<field> when fewer than n rows are left."""
    if start + n > len(order):
        raise ConfigError(f"data.{field}={n}: only {len(order) - start} {what} are left; lower data.{field}")
    return order[start : start + n]


def _table(df: pd.DataFrame) -> pa_arrow.Table:
    # preserve_index=False and no pandas metadata: the index is meaningless here and the metadata
    # embeds the pandas version, which would change the bytes across upgrades.
    table = pa_arrow.Table.from_pandas(df, preserve_index=False)
    return table.replace_schema_metadata(None)


def content_fingerprint(table: pa_arrow.Table) -> str:
    """sha256 (first 16 hex) of the Arrow IPC bytes of `table`: same content -> same fingerprint."""
    sink = pa_arrow.BufferOutputStream()
    with pa_arrow.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return hashlib.sha256(sink.getvalue().to_pybytes()).hexdigest()[:16]


def save_splits(splits: dict[str, pd.DataFrame], folder: Path | str) -> None:
    """Write `splits` as a DatasetDict to `folder` (replaced atomically). Same frames -> same bytes.

    An empty frame is refused (DataError naming the split): `datasets` writes it but cannot read it back.
    """
    import datasets  # heavy; only the stages that touch the disk need it

    for name, df in splits.items():
        if len(df) == 0:
            raise DataError(f"split {name!r} is empty (0 rows); not writing {folder}")
    dataset_dict = datasets.DatasetDict()
    for name in sorted(splits):  # sorted: dataset_dict.json lists splits in insertion order
        table = _table(splits[name])
        dataset_dict[name] = datasets.Dataset(table, fingerprint=content_fingerprint(table))
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # a bar per split is noise in stage logs
    try:
        with atomic_dir(folder) as tmp:
            dataset_dict.save_to_disk(str(tmp))
    finally:
        if bars:
            datasets.enable_progress_bars()


def load_split(folder: Path | str, name: str, schema: type[pa.DataFrameModel] | None = None) -> pd.DataFrame:
    """One split of a prepared folder as a DataFrame, validated against `schema` (default: SPLIT_SCHEMAS)."""
    import datasets

    folder = Path(folder)
    if not (folder / "dataset_dict.json").is_file():
        raise DataError(f"prepared data not found in {folder}; {_HINT}")
    if not (folder / name).is_dir():
        present = sorted(p.name for p in folder.iterdir() if p.is_dir())
        raise DataError(f"split {name!r} not found in {folder} (has: {', '.join(present) or 'none'}); {_HINT}")
    schema = schema or SPLIT_SCHEMAS.get(name)
    if schema is None:
        raise DataError(f"split {name!r} has no known schema; pass one (known: {', '.join(SPLIT_SCHEMAS)})")
    try:
        df = datasets.Dataset.load_from_disk(str(folder / name)).to_pandas()
    except (OSError, ValueError, IndexError) as e:  # IndexError: a split saved with 0 rows
        raise DataError(f"split {name!r} in {folder} is unreadable ({e}); {_HINT}") from None
    return validate(df, schema, f"split {name!r} in {folder}")
