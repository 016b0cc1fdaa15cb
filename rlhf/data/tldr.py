"""The paper's task (profile `pythia-tldr`, data.source=tldr): TL;DR summarisation, for GPU users with hub access.

Reads the paper's hub datasets by name (or an already-loaded DatasetDict, or a local folder of
train/validation files in the same columns) and maps them onto the SAME split names and schemas as the
reviews task, so every later stage is task-agnostic:
    prompts dataset (columns query, reference_response; splits train, validation[, test])
        train      -> sft (query + reference), reward_prompts, rl_prompts  (disjoint rows)
        validation -> eval_prompts (prompt = query, reference = reference_response)
    pairs dataset (columns prompt, chosen, rejected; splits train, validation)
        train -> gold_train, validation -> gold_test, as labelled texts: chosen -> 1, rejected -> 0.

The labelled-summary gold judge is a STAND-IN so the pipeline runs end to end: a TF-IDF classifier of
"was this summary preferred" is a weak proxy of summary quality. The paper's gold is a 6.9B reward model
trained on these pairs; GPU users should plug that in for real results.

Nothing here reaches the hub unless a hub id is passed and HF_HUB_OFFLINE is unset.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from rlhf.config import DataConfig
from rlhf.data.schemas import DataError
from rlhf.data.splits import take_rows

if TYPE_CHECKING:
    import datasets

EOS_MARKERS = ("<|endoftext|>",)  # the paper's datasets append the Pythia EOS text to responses
SOURCE = "tldr"
EVAL_SPLITS = ("validation", "test")


def load_hub_dataset(source: str | Path | datasets.DatasetDict, field: str) -> datasets.DatasetDict:
    """`source` as a DatasetDict: returned as is, or loaded with datasets.load_dataset (hub id or local folder)."""
    import datasets

    if isinstance(source, datasets.DatasetDict):
        return source
    try:
        loaded = datasets.load_dataset(str(source))
    except Exception as e:  # noqa: BLE001 - offline, missing, or malformed: all mean "cannot get the data"
        raise DataError(
            f"data.{field}: cannot load dataset {source!r} ({type(e).__name__}: {e}). The tldr task needs the hub "
            "(unset HF_HUB_OFFLINE / HF_DATASETS_OFFLINE on a machine with network) or a local copy."
        ) from None
    if not isinstance(loaded, datasets.DatasetDict):
        raise DataError(f"data.{field}: {source!r} did not load as a dataset with named splits")
    return loaded


def strip_eos(text: str) -> str:
    """Remove EOS marker text and surrounding whitespace from a response."""
    for marker in EOS_MARKERS:
        text = text.replace(marker, "")
    return text.strip()


def _frame(dd: datasets.DatasetDict, split: str, columns: list[str], field: str) -> pd.DataFrame:
    if split not in dd:
        raise DataError(f"data.{field}: no split {split!r} (has: {', '.join(dd)})")
    missing = [c for c in columns if c not in dd[split].column_names]
    if missing:
        raise DataError(f"data.{field}: split {split!r} lacks column(s) {', '.join(missing)}")
    return dd[split].select_columns(columns).to_pandas()


def _labelled(pairs: pd.DataFrame) -> pd.DataFrame:
    """(2P, 3) text/label/source from P pairs; texts that occur twice (even with other labels) are dropped."""
    texts = pd.concat([pairs["chosen"], pairs["rejected"]], ignore_index=True).map(strip_eos)
    labels = np.concatenate([np.ones(len(pairs), np.int64), np.zeros(len(pairs), np.int64)])
    out = pd.DataFrame({"text": texts, "label": labels, "source": SOURCE})
    out = out[out["text"] != ""]
    return out.drop_duplicates("text", keep=False).reset_index(drop=True)


def build_splits(
    prompts: datasets.DatasetDict, pairs: datasets.DatasetDict, cfg: DataConfig, seed: int
) -> dict[str, pd.DataFrame]:
    """The six splits of rlhf.data.splits from the TL;DR prompts and human pairs (see module docstring).

    prompt_id is the row index in the prompts train split, or len(train) + row index for eval prompts,
    so ids are unique across splits.
    """
    rng = np.random.default_rng(seed)
    train = _frame(prompts, "train", ["query", "reference_response"], "tldr_prompts_dataset")
    eval_split = next((s for s in EVAL_SPLITS if s in prompts), "validation")
    held_out = _frame(prompts, eval_split, ["query", "reference_response"], "tldr_prompts_dataset")

    order = rng.permutation(len(train))
    sft_ids = take_rows(order, 0, cfg.n_sft, "n_sft", "TL;DR train prompts")
    reward_ids = take_rows(
        order, len(sft_ids), cfg.n_reward_prompts, "n_reward_prompts", "TL;DR train prompts (after sft)"
    )
    rl_ids = take_rows(
        order,
        len(sft_ids) + len(reward_ids),
        cfg.n_rl_prompts,
        "n_rl_prompts",
        "TL;DR train prompts (after sft, reward)",
    )
    eval_ids = take_rows(
        rng.permutation(len(held_out)), 0, cfg.n_eval_prompts, "n_eval_prompts", f"TL;DR {eval_split} prompts"
    )

    def prompt_frame(frame: pd.DataFrame, rows: np.ndarray, offset: int) -> pd.DataFrame:
        return pd.DataFrame(
            {"prompt_id": (rows + offset).astype(np.int64), "prompt": frame["query"].iloc[rows].tolist()}
        )

    sft = train.iloc[sft_ids]
    gold_train = _labelled(_frame(pairs, "train", ["chosen", "rejected"], "tldr_pairs_dataset"))
    gold_test = _labelled(_frame(pairs, "validation", ["chosen", "rejected"], "tldr_pairs_dataset"))
    gold_test = gold_test[~gold_test["text"].isin(gold_train["text"])]  # disjoint texts
    gold_train = gold_train.iloc[rng.permutation(len(gold_train))]
    gold_test = gold_test.iloc[rng.permutation(len(gold_test))]
    n_test = int(round(len(gold_train) * cfg.gold_test_fraction / (1 - cfg.gold_test_fraction)))
    if cfg.max_gold_texts is not None:
        n_test = int(round(cfg.max_gold_texts * cfg.gold_test_fraction))
        gold_train = gold_train.iloc[: cfg.max_gold_texts - n_test]
    gold_test = gold_test.iloc[:n_test]

    return {
        "sft": pd.DataFrame(
            {"text": [q + " " + strip_eos(r) for q, r in zip(sft["query"], sft["reference_response"])]}
        ),
        "reward_prompts": prompt_frame(train, reward_ids, 0),
        "rl_prompts": prompt_frame(train, rl_ids, 0),
        "eval_prompts": prompt_frame(held_out, eval_ids, len(train)).assign(
            reference=held_out["reference_response"].iloc[eval_ids].map(strip_eos).tolist()
        ),
        "gold_train": gold_train.reset_index(drop=True),
        "gold_test": gold_test.reset_index(drop=True),
    }


def load_splits(
    cfg: DataConfig,
    seed: int,
    prompts: str | Path | datasets.DatasetDict | None = None,
    pairs: str | Path | datasets.DatasetDict | None = None,
) -> dict[str, pd.DataFrame]:
    """Splits from cfg.tldr_prompts_dataset / cfg.tldr_pairs_dataset (or the given DatasetDicts / folders)."""
    prompts_dd = load_hub_dataset(prompts if prompts is not None else cfg.tldr_prompts_dataset, "tldr_prompts_dataset")
    pairs_dd = load_hub_dataset(pairs if pairs is not None else cfg.tldr_pairs_dataset, "tldr_pairs_dataset")
    return build_splits(prompts_dd, pairs_dd, cfg, seed)
