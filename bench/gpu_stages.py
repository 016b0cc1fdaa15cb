"""What `make gpu-check`'s groups share (bench/gpu_check.py, bench/gpu_profile.py): a check, the settings of the
model shapes they run, and the child functions that run `rlhf` stages in the child process and read their figures."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("prepare", "gold", "sft", "reward", "train", "generate", "evaluate")
# b.: every memory-saving path at once, as a GPU user of a larger model would run it
TRAINER_SETTINGS = ("train.mixed_precision=bf16", "train.gradient_checkpointing=true", "train.lora.rank=4")
# e. and the profile group: the `ci` pipeline at Pythia-1B's shape (GPT-NeoX, 16 x 2048, 8 heads, MLP 8192; a 4k word
# vocabulary, not Pythia's 50k: ~0.82B parameters), its trainers as a GPU user would run them
PYTHIA_1B = (
    "model.architecture=gpt_neox",
    "model.hidden_size=2048",
    "model.num_layers=16",
    "model.num_heads=8",
    "model.intermediate_size=8192",
    "model.vocab_size=4096",
    "sft.learning_rate=3e-4",  # ci's 3e-3 suits a 100k-parameter model; at 0.82B: held-out loss 8.82 > ln 4096 (H200)
)


@dataclass
class Check:
    name: str
    func: str  # a key of gpu_check.CHILDREN, run in a child process
    args: dict = field(default_factory=dict)
    timeout: float = 120.0  # seconds; past it the check FAILs with "timeout"
    targets: dict = field(default_factory=dict)  # figure -> (">=" or "<=", bound): the issue's, printed beside it


def data_dir(cli: list[str]) -> Path:
    """The data_dir=<folder> a check's command line sets."""
    return Path(next(a for a in cli if a.startswith("data_dir=")).partition("=")[2])


def stage(device, cli: list[str]) -> dict:
    """`rlhf --profile ci <cli>` in this process; figures from the stage's metrics JSON (train: its csv)."""
    from rlhf.cli import main as rlhf_main

    code = rlhf_main(["--params", str(ROOT / "params.yaml"), "--profile", "ci", *cli])
    if code != 0:
        raise RuntimeError(f"rlhf {cli[0]} exited {code} (its error line is in the log)")
    return stage_figures(data_dir(cli), cli[0])


def stage_figures(data: Path, name: str) -> dict:
    """A stage's key figures: the train stage's number of updates, its first step's seconds, the mean of every other
    timing/* column and eps, its last objective/scores (rlhf.tracking.logged_rows); other stages' first four numbers
    of their metrics/<stage>.json."""
    if name == "train":  # the first update pays CUDA's warm-up: the others' means, where there are others
        from rlhf.tracking import logged_rows

        rows = logged_rows(data)
        steady = rows[1:] or rows
        mean = lambda k: sum(float(r[k]) for r in steady) / len(steady)  # noqa: E731
        keys = [k for k in rows[0] if k.startswith("timing/") and k != "timing/elapsed"] + ["eps"]
        figures = {"updates": len(rows), "first_step": round(float(rows[0]["timing/step"]), 3)}
        figures |= {k.removeprefix("timing/"): round(mean(k), 4) for k in keys}
        return {**figures, "scores": float(rows[-1]["objective/scores"])}
    path = data / "metrics" / f"{'eval' if name == 'evaluate' else name}.json"
    if not path.exists():  # generate writes generations, no metrics
        return {}
    metrics = json.loads(path.read_text())
    numbers = {k: v for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)}
    return dict(list(numbers.items())[:4])
