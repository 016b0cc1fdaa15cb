"""What each stage's outputs were built with: a record in every output folder, checked by the stages that read it.

`dvc repro` re-runs a stage whose params changed, so DVC users never meet a mismatch; `rlhf <stage>` by hand over
outputs built with other settings would silently mix them (a `ci` model trained and labelled `tiny`). The graph,
which folders a stage reads and which params sections decide it, is dvc.yaml's: one place for both tools.
"""

from __future__ import annotations

import functools
from pathlib import Path

import yaml

from rlhf.config import Config
from rlhf.io import read_json, write_json
from rlhf.runtime import PROJECT_ROOT

RECORD = "built_with.json"
# how a run logs, saves or collects its garbage, not what it makes
NOT_RESULTS = {"tracking", "train.keep_checkpoints", "train.save_every", "train.gc_every"}


@functools.cache  # read once per process: the check and the record both use it
def stage_graph(dvc_file: Path = PROJECT_ROOT / "dvc.yaml") -> dict[str, tuple[list[str], list[str]]]:
    """stage -> (the data folders it reads, the params sections that decide it), from dvc.yaml."""
    stages = yaml.safe_load(dvc_file.read_text(encoding="utf-8"))["stages"]
    return {
        name: (
            [d.split("/", 1)[1] for d in spec.get("deps", []) if d.startswith("data/")],
            [p for p in spec.get("params", []) if "$" not in p and p != "profile"],
        )
        for name, spec in stages.items()
    }


def settings(cfg: Config, sections: list[str]) -> dict[str, object]:
    """The resolved values of `sections`, flattened to dotted keys, without those that do not change results."""
    dumped = cfg.model_dump(mode="json")
    flat: dict[str, object] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}.{key}", inner)
        elif prefix not in NOT_RESULTS and prefix.split(".")[0] not in NOT_RESULTS:
            flat[prefix] = value

    for section in sections:
        walk(section, dumped[section])
    return flat


def record(cfg: Config, stage: str, folder: str) -> None:
    """After `stage` wrote data_dir/`folder`: what it was built with."""
    sections = stage_graph()[stage][1]
    write_json(cfg.path(folder, RECORD), {"stage": stage, "profile": cfg.profile, "settings": settings(cfg, sections)})


def check_inputs(cfg: Config, stage: str) -> None:
    """Before `stage` runs: each input folder with a record was built with the settings now in force."""
    graph = stage_graph()
    for folder in graph[stage][0]:
        path = cfg.path(folder, RECORD)
        if not path.is_file():
            continue  # built outside the CLI (the Python API, older outputs): nothing to compare
        built = read_json(path)
        now = settings(cfg, graph[built["stage"]][1])
        changed = sorted(k for k in now.keys() | built["settings"].keys() if now.get(k) != built["settings"].get(k))
        if changed:
            raise ValueError(
                f"{cfg.path(folder)} was built with other settings ({_differences(built, now, cfg.profile, changed)}): "
                f"re-run `rlhf {built['stage']}` and the stages after it, or `dvc repro`"
            )


def _differences(built: dict, now: dict, profile: str, changed: list[str], shown: int = 3) -> str:
    """What differs between a record and the settings now: the profile if it does, the first `shown` settings."""
    parts = [] if built["profile"] == profile else [f"profile {built['profile']} then, {profile} now"]
    parts += [f"{k}: {built['settings'].get(k)!r} then, {now.get(k)!r} now" for k in changed[:shown]]
    more = len(changed) - shown
    return "; ".join(parts) + (f"; and {more} more setting(s)" if more > 0 else "")
