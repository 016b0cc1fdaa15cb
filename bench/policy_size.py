"""The paper's Fig. 5, its policy half, on `tiny`: does a larger policy keep more of its result off-policy?

The paper (Pythia 410m to 2.8b, N = 1 to 64: N mini-batches sampled with one policy, then N updates): a larger policy
tightens the off-policy cluster, its off-policy runs land closer to its on-policy one; a larger reward model does not
(that half is not run here). Here two policy sizes from scratch, everything else held fixed:
  small  the `tiny` default (hidden 128, MLP 384: 1.38M parameters);
  large  hidden 256, MLP 768 (4.46M parameters, 3.2x), the same tokenizer (trained on the same texts), SFT recipe,
         data, RL settings and seeds;
both trained by online DPO (the algorithm the paper found most robust; which one its Fig. 5 used is not in
shared/reference/algorithms.md, so the choice is ours) at N = 1 and N = 16, RL seeds 3, 4, 5. The proxy reward model
is the same for every point: the pipeline's own (`data/reward/model` as HEAD's dvc.lock has it), copied once to
.cache/bench/policy_size/ and passed as `reward.pretrained`, so the small points too use it that way.

  python bench/policy_size.py list               every point's name and settings
  python bench/policy_size.py queue [--jobs J]   queue the missing points (bench/dvc_points.py), wait
  python bench/policy_size.py report             bench/metrics/policy_size.{csv,md}
  --large-sft-lr LR                              the large size's SFT at learning rate LR (points ps-large-lrLR-*,
                                                 tables policy_size-lrLR.*); default: `tiny`'s, 3e-3
  --large-rl-lr LR                               and its RL (train.learning_rate) at LR (-rlLR in both names)

The rule, fixed in the commit that added this file, before any point ran: a size's retention is its gain over SFT
at N = 16 over its gain at N = 1, (win-rate - 0.5) / (win-rate - 0.5), per seed, read at the policies kept after 25%
and 50% of the episodes (the off-policy grid's second rule: on `tiny` the final policies are past the point where the
judge's win-rate stops rising). The paper's claim holds here if the large policy's retention, seeds averaged, is
above the small one's by more than the seeds' spread (the larger half-range of either size's retention over the
seeds) at both. Where a size's N = 1 policy gained no more than 0.02 over SFT its retention is undefined: no verdict.

The second run (`--large-sft-lr 0.001`), its rule fixed before its points ran: the first run's large policy was larger
but no better (SFT held-out loss 4.465 against the small one's 4.424: `tiny`'s learning rate, 3e-3, is too high for
it; 1e-3 gave 4.355). The same rule, unchanged, read again with the large SFT at 1e-3, where it is also the better
model; the report states both sizes' held-out losses, and the test is a test of the paper's claim only if the large
one's is the lower.

The third run (`--large-sft-lr 0.001 --large-rl-lr 0.00015`), fixed before its points ran: the second run's claim held
by the rule, narrowly, with the large policy over-optimising the held RM at N = 1 at once (KL 22.8 by 25% of the
episodes, the small policy's 5.8), under the RL settings both sizes share, as the paper's do. Here the large policy's
RL learning rate is halved (3e-4 -> 1.5e-4; the width doubled: muP's scaling of Adam's step for hidden weights),
nothing else changed; the same rule, read again. It asks whether the second run's verdict survives an RL step sized
for the width; the report's table gives the N = 1 KL to tell whether the over-optimisation went.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import shutil
import subprocess
import sys

import dvc_points
import offpolicy
import pandas as pd
from common import positive_float, run_main  # bench/ is sys.path[0]

from rlhf.io import write_text

SIZES = {"small": [], "large": ["model.hidden_size=256", "model.intermediate_size=768"]}
MINI_BATCHES = (1, 16)
SEEDS = (3, 4, 5)
RULE_AT = (0.25, 0.5)
HELD = dvc_points.ROOT / ".cache" / "bench" / "policy_size"  # the held reward model and where it came from
STEM = "policy_size"


def large_settings(sft_lr: str | None = None, rl_lr: str | None = None) -> list[str]:
    """The large size's `-S` settings: its width, and its SFT and RL learning rates where given."""
    return SIZES["large"] + [
        f"{key}={lr}" for key, lr in (("sft.learning_rate", sft_lr), ("train.learning_rate", rl_lr)) if lr
    ]


def tag(sft_lr: str | None, rl_lr: str | None = None) -> str:
    """What a run with the large SFT at `sft_lr` (and RL at `rl_lr`) adds to the large points' names and the tables'
    stem."""
    return (f"-lr{sft_lr}" if sft_lr else "") + (f"-rl{rl_lr}" if rl_lr else "")


def lr_label(sft_lr: str | None) -> str:
    """The large SFT's learning rate, as the reports name it."""
    return f"{sft_lr} (`--large-sft-lr`)" if sft_lr else "`tiny`'s (3e-3)"


def points(rm=HELD / "reward_model", sft_lr: str | None = None, rl_lr: str | None = None) -> dict[str, list[str]]:
    """Every point: ps-<size>[-lr<LR>][-rl<LR>]-n<N>-s<seed>, its `-S` settings; a large point queued first. Each large
    point builds the large SFT policy itself (8.5 min on one thread): DVC's queue restored no stage from another
    queued experiment's run cache (seen 2026-11-28: every large point ran `sft`, all to the same held-out loss)."""
    settings = {"small": SIZES["small"], "large": large_settings(sft_lr, rl_lr)}
    names = {"small": "small", "large": f"large{tag(sft_lr, rl_lr)}"}
    pts = {
        f"ps-{names[size]}-n{n}-s{seed}": [
            "train.trainer=online_dpo",
            f"train.num_mini_batches={n}",
            f"train.seed={seed}",
            f"reward.pretrained={rm}",
            *settings[size],
        ]
        for size, n, seed in itertools.product(SIZES, MINI_BATCHES, SEEDS)
    }
    large = [n for n in pts if n.startswith("ps-large")]
    order = [large[0], *(n for n in pts if n.startswith("ps-small")), *large[1:]]
    return {n: pts[n] for n in order}


def hold_reward_model() -> None:
    """Copy the pipeline's reward model to HELD once (it must be what HEAD's dvc.lock records), with its origin."""
    if (HELD / "source.json").is_file():
        return
    if dvc_points.stale(["reward"]):
        sys.exit("policy_size: data/reward is not what dvc.lock records; run `dvc repro reward` (or `make run`) first")
    model = dvc_points.ROOT / "data" / "reward" / "model"
    shutil.rmtree(HELD / "reward_model", ignore_errors=True)
    shutil.copytree(model, HELD / "reward_model")
    digest = hashlib.sha256((model / "model.safetensors").read_bytes()).hexdigest()
    head = ["git", "rev-parse", "--short", "HEAD"]
    commit = subprocess.run(head, cwd=dvc_points.ROOT, text=True, capture_output=True, check=True).stdout.strip()
    (HELD / "source.json").write_text(json.dumps({"commit": commit, "model.safetensors sha256": digest}) + "\n")


def kept_policies(exps: dict[str, str], pts: dict[str, list[str]], stem: str, size_of, varied: tuple) -> pd.DataFrame:
    """Every kept policy (fraction > 0) of every point (bench/offpolicy.py's rows), `size_of(point name)` as the
    grid's `algorithm`: small or large; the `varied` stages' outputs may differ by size, no other. A point not run
    yet ends the script, naming it."""
    if missing := [n for n in pts if n not in exps]:
        sys.exit(f"{stem}: not run yet: {missing}; the bench's `queue` runs them")
    rows = dvc_points.frontier_rows(exps, pts, {stage: size_of for stage in varied})
    rows = rows.assign(algorithm=rows["point"].map(size_of))
    return rows[rows["fraction"] > 0]


def write_report(stem: str, kept: pd.DataFrame, size: str, head: list[str], verdict_lines: list[str]) -> int:
    """bench/metrics/<stem>.{csv,md}: `head`, then per size (the column named `size`), N and kept policy the seeds'
    mean episode, win-rate vs SFT and KL, then `verdict_lines`; printed too."""
    table = kept.groupby(["algorithm", "N", "fraction"])[["episode", "win_rate_vs_sft", "kl"]].mean().reset_index()
    table = table.rename(columns={"algorithm": size})
    floats = ("g", "g", "g", ".0f", ".3f", ".2f")
    text = "\n".join([*head, "", table.to_markdown(index=False, floatfmt=floats), "", *verdict_lines])
    offpolicy.OUT.mkdir(parents=True, exist_ok=True)
    write_text(offpolicy.OUT / f"{stem}.csv", kept.to_csv(index=False))
    write_text(offpolicy.OUT / f"{stem}.md", text + "\n")
    print(text + f"\n{stem}: -> {offpolicy.OUT}/{stem}.{{csv,md}}")
    return 0


def stage_metrics(exps: dict[str, str], pts: dict[str, list[str]]) -> list[str]:
    """Per size: the SFT policy's parameters and held-out loss, the held RM's agreement with gold on its samples;
    then whether the larger policy is also the better one (the lower held-out loss)."""
    lines = ["| policy | parameters | SFT held-out loss | the held RM's agreement with gold on its pairs |"]
    lines.append("|---|---|---|---|")
    loss = {}
    for size in SIZES:
        rev = exps[next(n for n in pts if n.startswith(f"ps-{size}-"))]
        sft = json.loads(dvc_points.committed(rev, "data/metrics/sft.json"))
        rm = json.loads(dvc_points.committed(rev, "data/metrics/reward.json"))
        loss[size] = sft["heldout_loss"]
        lines.append(f"| {size} | {sft['n_params']:,} | {loss[size]:.3f} | {rm['agreement_heldout']:.3f} |")
    better = (
        "also the better model" if loss["large"] < loss["small"] else "larger but not better (the paper's are both)"
    )
    gap = f"{loss['large']:.3f} against {loss['small']:.3f}"
    return [*lines, "", f"The large policy is {better}: SFT held-out loss {gap}, lower is better."]


def retention_table(kept: pd.DataFrame, label: str = "") -> tuple[list[str], dict[float, tuple[float, float]]]:
    """Retention per size (`algorithm`: small, large) and seed at each kept policy: the table's lines, and where
    both sizes' retention is defined at every seed, {fraction: (large - small, seeds' spread)}. `label` follows the
    size in the header ("RM": small RM)."""
    name = f" {label}" if label else ""
    lines = [f"| kept policy | small{name}: retention (seeds) | large{name}: retention (seeds) | large - small | "]
    lines[0] += "seeds' spread |"
    lines.append("|---|---|---|---|---|")
    gaps = {}
    for fraction in sorted(kept["fraction"].unique()):
        per_seed = offpolicy.retention(kept[kept["fraction"] == fraction])
        defined = per_seed.dropna()
        mean, spread = offpolicy.retained(defined)
        cells = [
            f"{mean[s]:.2f} ({', '.join(f'{r:.2f}' for r in defined[defined['algorithm'] == s]['retention'])})"
            if s in mean
            else "undefined"
            for s in SIZES
        ]
        if set(SIZES) <= set(mean.index) and len(defined) == len(per_seed):
            gaps[fraction] = (float(mean["large"] - mean["small"]), spread)
            lines.append(f"| {fraction:.0%} | {cells[0]} | {cells[1]} | {gaps[fraction][0]:+.2f} | {spread:.2f} |")
        else:
            lines.append(f"| {fraction:.0%} | {cells[0]} | {cells[1]} | - | - |")
    return lines, gaps


def verdict(kept: pd.DataFrame) -> list[str]:
    """The rule of the docstring: retention per size and seed at each kept policy, and the verdict at RULE_AT."""
    lines, gaps = retention_table(kept)
    if not all(f in gaps for f in RULE_AT):
        return [*lines, "", "No verdict: a size's retention is undefined at a kept policy the rule reads."]
    holds = all(gaps[f][0] > gaps[f][1] for f in RULE_AT)
    return [
        *lines,
        "",
        f"By the rule (retention at 25% and 50%, fixed before the points ran) the paper's claim that a larger policy "
        f"is more robust off-policy {'holds' if holds else 'does not hold'} here.",
    ]


def report(pts: dict[str, list[str]], sft_lr: str | None = None, rl_lr: str | None = None) -> int:
    exps = dvc_points.experiments()  # `dvc exp show` over every commit: seconds, read once
    # the SFT policy is the size; the reward stage measures the held RM on that policy's pairs
    kept = kept_policies(exps, pts, STEM, lambda name: name.split("-")[1], varied=("sft", "reward"))
    source = json.loads((HELD / "source.json").read_text())
    head = [
        f"# Policy size and off-policy robustness (the paper's Fig. 5), `tiny`, online DPO, seeds "
        f"{', '.join(map(str, SEEDS))}",
        "",
        f"The held reward model: the pipeline's at commit {source['commit']} (model.safetensors sha256 "
        f"{source['model.safetensors sha256'][:12]}). The large policy's SFT learning rate: {lr_label(sft_lr)}"
        + (f"; its RL learning rate: {rl_lr} (`--large-rl-lr`)." if rl_lr else "."),
        "",
        *stage_metrics(exps, pts),
    ]
    return write_report(STEM + tag(sft_lr, rl_lr), kept, "policy", head, verdict(kept))


def learning_rate(text: str) -> str:
    """argparse type: a learning rate > 0, as the point names and `-S` settings write it (`1e-3` -> `0.001`)."""
    return f"{positive_float(text):g}"


def parser(doc: str) -> argparse.ArgumentParser:
    """bench/offpolicy.py's point parser and `--large-sft-lr` (this bench's and bench/rm_size.py's)."""
    ap = dvc_points.point_parser(doc)
    ap.add_argument("--large-sft-lr", type=learning_rate, help="the large SFT's learning rate (default: the profile's)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--large-rl-lr", type=learning_rate, help="the large policy's RL learning rate (train.*)")
    args = ap.parse_args(argv)
    sft_lr, rl_lr = args.large_sft_lr, args.large_rl_lr
    if args.command == "queue":
        hold_reward_model()
    pts = points(sft_lr=sft_lr, rl_lr=rl_lr)
    return dvc_points.run_points(args.command, pts, args.jobs, lambda: report(pts, sft_lr, rl_lr))


if __name__ == "__main__":
    sys.exit(run_main(main))
