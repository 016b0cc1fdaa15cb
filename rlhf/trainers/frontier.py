"""train.eval_checkpoints: the policy kept at fractions of the run, for the win-rate vs KL frontier of `evaluate`.

The paper's evidence is a curve through training, not one number, so the stages after `train` score the policy at
each kept point. While the run goes on they live in its resume folder (a re-run of the stage deletes data/train
first, and a resumed run must not lose the points it already passed); when it finishes they move to
data/train/frontier/episode-<n>, beside the final policy (the point at 1.0). Each is saved as the final policy is:
a transformers folder vLLM loads too (merged weights and the adapter for LoRA).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from rlhf.generation.weights import full_weights
from rlhf.io import atomic_dir, link_or_copy
from rlhf.models.loading import save_policy

FOLDER = "frontier"


def frontier_batches(fractions: list[float], num_batches: int) -> set[int]:
    """The batch counts after which a policy is kept: round(f * num_batches), at least 1; the last batch's policy is
    the final one, saved anyway."""
    return {max(1, round(f * num_batches)) for f in fractions} - {num_batches}


def keep(run, episode: int) -> None:
    """Save the policy as it is now under the run's resume folder. Every rank calls it (a collective under ZeRO-3)."""
    with full_weights(run.policy) as weights:
        if run.acc.is_main_process:
            with atomic_dir(run.ckpt_dir / FOLDER / f"episode-{episode:07d}") as tmp:
                save_policy(run.policy, weights, run.tokenizer, tmp)
    run.acc.wait_for_everyone()


def publish(ckpt_dir: Path, train_dir: Path) -> None:
    """The run's kept policies as data/train/frontier (main process, when the run has finished), by hard links: the
    checkpoint folder keeps them until the stage's outputs are all in place (rlhf.io.published_together)."""
    with atomic_dir(train_dir / FOLDER) as dest:
        for folder in sorted((ckpt_dir / FOLDER).glob("episode-*")):
            shutil.copytree(folder, dest / folder.name, copy_function=link_or_copy)


def kept_policies(train_dir: Path) -> list[tuple[int, Path]]:
    """(episode, folder) of each kept policy in data/train/frontier, oldest first; the final policy is not listed."""
    folders = sorted((train_dir / FOLDER).glob("episode-*"))
    return [(int(folder.name.removeprefix("episode-")), folder) for folder in folders]
