import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rlhf import runtime  # noqa: E402

runtime.configure()

import pytest  # noqa: E402

from rlhf.config import load_config  # noqa: E402


def ci_config(data_dir, *overrides):
    """The `ci` profile of the real params.yaml, writing under `data_dir`, W&B off unless asked."""
    return load_config(ROOT / "params.yaml", "ci", [f"data_dir={data_dir}", "tracking.wandb_mode=disabled", *overrides])


@pytest.fixture(scope="session")
def ci_stages(tmp_path_factory):
    """prepare -> gold -> sft -> reward on the `ci` profile, run once per test session (real data, real models)."""
    from rlhf.stages import gold, prepare, reward, sft

    data_dir = tmp_path_factory.mktemp("ci") / "data"
    cfg = ci_config(data_dir)
    for stage in (prepare, gold, sft, reward):
        stage.run(cfg)
    return data_dir


@pytest.fixture
def ci_data(ci_stages, tmp_path):
    """A private copy of the session's stage outputs, so a test may write train/ and checkpoints freely."""
    import shutil

    data_dir = tmp_path / "data"
    shutil.copytree(ci_stages, data_dir)
    return data_dir
