"""A stage's outputs move into place together (rlhf.io.published_together): all of a run's, or none of them, with
the previous run's kept whole and no temporary left behind, whichever write fails."""

from __future__ import annotations

import errno
import os

import pytest
from conftest import folder_digest

from rlhf import io


def previous_run(root):
    """A data folder as a previous run left it: a model folder, a config beside it, metrics in another folder."""
    (root / "train" / "policy").mkdir(parents=True)
    (root / "train" / "policy" / "model.safetensors").write_text("old weights")
    (root / "train" / "config.yaml").write_text("lr: 0.001\n")
    (root / "metrics").mkdir()
    (root / "metrics" / "train.json").write_text('{"old": 1}\n')
    return folder_digest(root)


def write_run(root, fail_in_the_middle=False):
    """A run's writes, in a stage's order: the policy folder, a record inside it, its config, then the metrics."""
    with io.atomic_dir(root / "train" / "policy") as tmp:
        (tmp / "model.safetensors").write_text("new weights")
    io.write_json(root / "train" / "policy" / "built_with.json", {"stage": "train"})  # inside the staged folder
    io.write_text(root / "train" / "config.yaml", "lr: 0.01\n")
    if fail_in_the_middle:
        raise RuntimeError("the run failed after writing half its outputs")
    io.write_json(root / "metrics" / "train.json", {"new": 1})
    io.write_text(root / "plots" / "train.csv", "a,b\n")  # in a folder that does not exist yet


def outputs(root):
    """The stage's output folders, as `rlhf <stage>` names them: its own, metrics, plots."""
    return [root / "train", root / "metrics", root / "plots"]


def names(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_outputs_move_in_together_at_the_end(tmp_path):
    previous_run(tmp_path)
    ran = []
    with io.published_together(outputs(tmp_path)):
        write_run(tmp_path)
        io.after_publishing(lambda: ran.append("checkpoints deleted"))
        io.write_text(tmp_path / "checkpoints" / "state.json", "{}")  # not an output folder: lands at once
        assert (tmp_path / "checkpoints" / "state.json").read_text() == "{}"
        assert (tmp_path / "train" / "config.yaml").read_text() == "lr: 0.001\n"  # no output visible yet
        assert not (tmp_path / "plots" / "train.csv").exists() and not ran
    assert (tmp_path / "train" / "policy" / "model.safetensors").read_text() == "new weights"
    assert (tmp_path / "train" / "policy" / "built_with.json").is_file()
    assert (tmp_path / "train" / "config.yaml").read_text() == "lr: 0.01\n"
    assert (tmp_path / "metrics" / "train.json").read_text() == '{\n  "new": 1\n}\n'
    assert (tmp_path / "plots" / "train.csv").read_text() == "a,b\n"
    assert ran == ["checkpoints deleted"]
    assert not [n for n in names(tmp_path) if ".tmp-" in n or ".old-" in n]


def test_a_failed_run_leaves_the_previous_outputs_whole_and_no_temporary(tmp_path):
    before, listing = previous_run(tmp_path), names(tmp_path)
    ran = []
    with pytest.raises(RuntimeError, match="half its outputs"), io.published_together(outputs(tmp_path)):
        io.after_publishing(lambda: ran.append("checkpoints deleted"))
        write_run(tmp_path, fail_in_the_middle=True)
    assert folder_digest(tmp_path) == before and names(tmp_path) == listing and not ran


@pytest.mark.parametrize("failing_move", [1, 2, 4])  # of 4: policy, config.yaml, train.json, train.csv
def test_a_move_failing_half_way_puts_every_previous_output_back(tmp_path, monkeypatch, failing_move):
    """The n-th rename of the commit fails (a full disk, a file system gone read-only): the outputs that had moved
    in already go back to the previous ones."""
    before, listing = previous_run(tmp_path), names(tmp_path)
    real_replace, moves = os.replace, []

    def replace(src, dst):
        if ".tmp-" in str(src) and ".tmp-" not in str(dst):  # the commit moving a new output in
            moves.append(dst)
            if len(moves) == failing_move:
                raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="No space left"), io.published_together(outputs(tmp_path)):
        write_run(tmp_path)
    assert len(moves) == failing_move  # the failure was the commit's, after `failing_move - 1` outputs moved in
    assert folder_digest(tmp_path) == before and names(tmp_path) == listing


def test_a_folder_in_the_way_of_an_output_file_stops_the_commit_before_anything_moves(tmp_path):
    previous_run(tmp_path)
    (tmp_path / "metrics" / "train.json").unlink()
    (tmp_path / "metrics" / "train.json").mkdir()
    before, listing = folder_digest(tmp_path), names(tmp_path)
    with pytest.raises(IsADirectoryError) as err, io.published_together(outputs(tmp_path)):
        write_run(tmp_path)
    assert err.value.filename == str(tmp_path / "metrics" / "train.json")
    assert folder_digest(tmp_path) == before and names(tmp_path) == listing


def test_without_a_publication_each_write_moves_in_at_once_and_a_failed_one_leaves_no_temporary(tmp_path):
    io.write_text(tmp_path / "a.txt", "a")
    assert (tmp_path / "a.txt").read_text() == "a"
    (tmp_path / "b.txt").mkdir()
    with pytest.raises(IsADirectoryError):
        io.write_text(tmp_path / "b.txt", "b")
    assert names(tmp_path) == ["a.txt", "b.txt"]
