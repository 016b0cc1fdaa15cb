"""Finished experiments' small files, committed: a bench's points outlive DVC's experiment refs.

A point of a bench (bench/dvc_points.py) is a DVC experiment: a commit under refs/exps that only this
clone holds until `dvc exp push` sends it to a Git remote. Where there is none to push to, or a grid takes longer
than one sitting (the SmolLM2 grid: ~3.5 h), `keep` copies what the reports read from each finished point's commit
(data/metrics/*.json, data/plots/*.csv, dvc.lock's stage outputs and, from the DVC cache, each eval prompt's gold
outcome against SFT's: `WINS`, for intervals over prompts; ~40 kB) to bench/metrics/points/<name>/, and
`revisions` offers those folders back as revisions that `read` opens like `git show rev:path`. A point kept there is
finished: `queue` does not run it again, and the report checks its inputs (dvc.lock's output md5s) like any other.
"""

from __future__ import annotations

import io
import subprocess
from pathlib import Path

import pandas as pd
import yaml

from rlhf.io import write_text

TAG = "kept:"  # a kept point's revision: kept:<name>, never a Git revision (no ':' in those)
FOLDERS = ("data/metrics", "data/plots")  # the tracked (cache: false) outputs a report reads
RESULTS = "data/eval/results"  # the evaluate stage's per-prompt results (a DVC output: in the cache, not in Git)
WINS = "prompt_wins.csv"  # prompt_id, then per kept policy (policy@<episode>, the final `policy`): 1, 0.5 or 0


def git(root: Path, *args: str) -> str:
    """`git ARGS`'s stdout in `root`; a failure raises (CalledProcessError, with git's message)."""
    return subprocess.run(["git", *args], cwd=root, text=True, capture_output=True, check=True).stdout


def revisions(folder: Path) -> dict[str, str]:
    """Every kept point: name -> its revision (kept:<name>)."""
    found = sorted(p.name for p in folder.iterdir() if (p / "dvc.lock").is_file()) if folder.is_dir() else []
    return {name: TAG + name for name in found}


def read(folder: Path, rev: str, path: str) -> str | None:
    """`path`'s text as kept for revision `rev`; None when `rev` is a Git revision, not a kept point's."""
    if not rev.startswith(TAG):
        return None
    return (folder / rev.removeprefix(TAG) / path).read_text()


def prompt_wins(root: Path, rev: str) -> str | None:
    """`WINS`'s text for experiment revision `rev`, from its evaluate output in the DVC cache (rlhf.stages.evaluate's
    `wins`: the rule its win-rates average); None where the cache does not hold it (an experiment pulled without
    its outputs)."""
    import pyarrow as pa
    from dvc.api import DVCFileSystem
    from dvc_data.index.index import DataIndexDirError

    from rlhf.stages.evaluate import wins

    try:
        fs = DVCFileSystem(str(root), rev=rev)
        shards = sorted(p for p in fs.ls(RESULTS, detail=False) if p.endswith(".arrow"))
        tables = [pa.ipc.open_stream(fs.read_bytes(p)).read_all() for p in shards]
    except (FileNotFoundError, DataIndexDirError):  # not in the cache
        return None
    if not tables:
        return None
    gold = pa.concat_tables(tables).to_pandas().pivot(index="prompt_id", columns="model", values="gold")
    kept = [m for m in gold.columns if m == "policy" or m.startswith("policy@")]
    frame = pd.DataFrame({m: wins(gold[m].to_numpy(), gold["sft"].to_numpy()) for m in kept}, index=gold.index)
    return frame.to_csv()


def wins_of(root: Path, folder: Path, rev: str) -> pd.DataFrame | None:
    """`WINS` of revision `rev` as a frame, a row per eval prompt (prompt_id ascending), a column per kept policy:
    kept with the point in `folder`, or from the DVC cache for a Git revision; None where neither holds it."""
    if rev.startswith(TAG):
        path = folder / rev.removeprefix(TAG) / WINS
        text = path.read_text() if path.is_file() else None
    else:
        text = prompt_wins(root, rev)
    return None if text is None else pd.read_csv(io.StringIO(text), index_col="prompt_id").sort_index()


def lock_outputs(lock_text: str) -> str:
    """dvc.lock reduced to each stage's outputs (paths and md5s): what a report checks a point's inputs by."""
    stages = yaml.safe_load(lock_text)["stages"]
    kept = {s: {"outs": [{"path": o["path"], "md5": o["md5"]} for o in v.get("outs", [])]} for s, v in stages.items()}
    return yaml.safe_dump({"schema": "2.0", "stages": kept}, sort_keys=False)


def keep(root: Path, folder: Path, exps: dict[str, str], names) -> list[str]:
    """Copy each of `names` that `exps` holds as a Git revision and `folder` not yet to folder/<name>/; the names
    copied. The folder's dvc.lock is written last: a point half copied (killed meanwhile) is not kept."""
    copied = []
    for name in (n for n in names if n in exps and not exps[n].startswith(TAG)):
        rev, dest = exps[name], folder / name
        if (dest / "dvc.lock").is_file():
            continue
        files = git(root, "ls-tree", "-r", "--name-only", rev, "--", *FOLDERS).split()
        for path in files:
            write_text(dest / path, git(root, "show", f"{rev}:{path}"))
        if (wins := prompt_wins(root, rev)) is not None:
            write_text(dest / WINS, wins)
        write_text(dest / "dvc.lock", lock_outputs(git(root, "show", f"{rev}:dvc.lock")))
        copied.append(name)
    return copied
