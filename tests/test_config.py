"""params.yaml + profiles + overrides: what loads, and the errors that name the key."""

import pytest

from conftest import PARAMS, run_cli
from rlhf.config import ConfigError, load_config, profiles


@pytest.mark.parametrize("profile", ["tiny", "smollm2", "pythia-tldr", "ci"])
def test_every_profile_loads_and_validates(profile):
    cfg = load_config(PARAMS, profile)
    assert cfg.profile == profile
    assert cfg.train.total_episodes % (cfg.train.per_device_train_batch_size * cfg.train.gradient_accumulation_steps * cfg.train.num_mini_batches) == 0


def test_profiles_listed():
    assert profiles(PARAMS) == ["ci", "pythia-tldr", "smollm2", "tiny"]


def test_default_profile_comes_from_params_and_top_level_sections_win_over_the_profile():
    cfg = load_config(PARAMS)
    assert cfg.profile == "tiny"
    assert cfg.train.trainer == "online_dpo"  # top-level `train.trainer` of params.yaml
    assert cfg.model.hidden_size == 128  # from profiles.tiny


def test_overrides_keep_types_and_reach_nested_keys():
    cfg = load_config(PARAMS, "ci", ["train.learning_rate=1e-5", "train.k=4", "model.source=local", "model.path=/x"])
    assert cfg.train.learning_rate == 1e-5 and isinstance(cfg.train.learning_rate, float)
    assert cfg.train.k == 4 and cfg.model.path == "/x"


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.lr=1e-4", "train.lr: unknown key"),
        ("nosection.x=1", "nosection: unknown key"),
        ("train.k=two", "train.k: Input should be a valid integer"),
        ("train.per_device_train_batch_size=2.5", "train.per_device_train_batch_size: Input should be a valid integer"),
        ("train.learning_rate=-1", "train.learning_rate: Input should be greater than 0"),
        ("train.total_episodes=10", "train.total_episodes (10) must be divisible by the prompts per batch"),
        ("train.trainer=ppo2", "train.trainer: Input should be 'ppo'"),
        ("model.hidden_size=33", "model.hidden_size (33) must be divisible by model.num_heads"),
        ("model.source=local", "model.path is required when model.source=local"),
        ("train.k=1", "train.k must be >= 2"),
        ("train.tis_cap=2", "train.tis_cap weights policy-gradient advantages"),
        ("model.num_heads=4", "model.hidden_size / model.num_heads = 16: vLLM's CPU attention supports"),
        ("train.learning_rate", "must look like section.key=value"),
    ],
)
def test_bad_values_fail_at_load_time_naming_the_key(override, message):
    engine = ["train.engine=vllm"] if "vLLM" in message else []
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(PARAMS, "ci", [override, *engine])


def test_unknown_profile_lists_the_valid_ones():
    with pytest.raises(ConfigError, match="unknown profile 'nope'; valid profiles in .*: ci, pythia-tldr, smollm2, tiny"):
        load_config(PARAMS, "nope")


def test_malformed_yaml_and_wrong_top_level_name_the_file(tmp_path):
    bad = tmp_path / "params.yaml"
    bad.write_text("profile: tiny\nprofiles: {tiny: {train: [1, 2}\n")
    with pytest.raises(ConfigError, match=f"{bad}: malformed YAML"):
        load_config(bad)
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(bad)
    with pytest.raises(ConfigError, match="params file not found"):
        load_config(tmp_path / "missing.yaml")


def test_non_utf8_params_file_is_named(tmp_path):
    bad = tmp_path / "params.yaml"
    bad.write_bytes(b"profile: tiny\nseed: \xff\xfe\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(bad)


def test_cli_help_lists_the_stages():
    proc = run_cli("--help")
    assert proc.returncode == 0
    for stage in ("prepare", "gold", "sft", "reward", "train", "generate", "evaluate"):
        assert stage in proc.stdout


def test_cli_bad_input_exits_non_zero_with_the_key_in_the_message():
    proc = run_cli("--profile", "ci", "config", "train.lr=1")
    assert proc.returncode == 1 and "train.lr: unknown key" in proc.stderr
    proc = run_cli("--profile", "nope", "config")
    assert proc.returncode == 1 and "valid profiles" in proc.stderr
    proc = run_cli("train", "--trainer", "nope")
    assert proc.returncode == 1 and "train.trainer" in proc.stderr


def test_cli_config_prints_the_resolved_values():
    proc = run_cli("--profile", "ci", "config", "train.k=3")
    assert proc.returncode == 0 and "k: 3" in proc.stdout and "profile: ci" in proc.stdout


def test_cli_missing_inputs_name_the_file_and_the_fix(tmp_path):
    proc = run_cli("--profile", "ci", "sft", f"data_dir={tmp_path}")
    assert proc.returncode == 1 and "rlhf prepare" in proc.stderr and str(tmp_path) in proc.stderr
    proc = run_cli("--profile", "ci", "prepare", f"data_dir={tmp_path}", "data.reviews_csv=/nonexistent/reviews.csv")
    assert proc.returncode == 1 and "/nonexistent/reviews.csv" in proc.stderr
    assert not (tmp_path / "prepared").exists()  # nothing half-written
