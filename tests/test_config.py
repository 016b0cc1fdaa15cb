"""params.yaml + profiles + overrides: what loads, and the errors that name the key."""

import inspect
import re
import subprocess
import sys
import textwrap

import pytest
import yaml
from conftest import PARAMS, ROOT, run_cli
from pydantic import BaseModel

from rlhf.config import Config, ConfigError, load_config, profiles
from rlhf.presets import ENGINES, PRESETS


@pytest.mark.parametrize("profile", ["tiny", "smollm2", "smollm2-math", "pythia-tldr", "ci"])
def test_every_profile_loads_and_validates(profile):
    cfg = load_config(PARAMS, profile)
    assert cfg.profile == profile
    assert (
        cfg.train.total_episodes
        % (cfg.train.per_device_train_batch_size * cfg.train.gradient_accumulation_steps * cfg.train.num_mini_batches)
        == 0
    )


def test_profiles_listed():
    assert profiles(PARAMS) == ["ci", "pythia-tldr", "smollm2", "smollm2-math", "tiny"]


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
        ("train.penalty_reward_value=.nan", "train.penalty_reward_value: Input should be a finite number"),
        ("train.learning_rate=.inf", "train.learning_rate: Input should be a finite number"),
        ("train.tis_cap=-.inf", "train.tis_cap: Input should be a finite number"),
        ("train.decoupled_cap=1", "train.decoupled_cap: Input should be greater than 1"),
        ("train.engine_device=gpu", "train.engine_device: String should match pattern"),
        ("train.max_staleness=0", "train.max_staleness: 0 with the vllm_async engine (online_dpo_vllm), which samples"),
        ("train.engine_device=cuda:1", "train.engine_device: cuda:1 places a vLLM engine, and ppo samples with HF"),
        # a seed numpy, torch and scikit-learn all take: numpy's own "expected non-negative integer" named no setting
        ("seed=-1", "seed: Input should be greater than or equal to 0"),
        ("train.seed=-5", "train.seed: Input should be greater than or equal to 0"),
        ("seed=4294967296", "seed: Input should be less than 4294967296"),
        ("train.weight_updates=in_flight", "train.weight_updates: in_flight updates the weights of an engine that"),
        ("train.in_flight_step=4", "train.in_flight_step applies to in-flight updates: set train.weight_updates"),
        ("train.weight_updates=eventually", "train.weight_updates: Input should be 'between_batches' or 'in_flight'"),
        ("train.engine_resource=engine", "train.engine_resource: engine places Ray actors: it needs train.engine"),
        ("train.engine_resource=a b", "train.engine_resource: String should match pattern"),
        ("train.engine_resource=CPU", "train.engine_resource: CPU is one of Ray's own resources, which every engine"),
    ],
)
def test_bad_values_fail_at_load_time_naming_the_key(override, message):
    engine = ["train.engine=vllm"] if "vLLM's CPU" in message else []
    engine += ["train.trainer=online_dpo_vllm"] if "vllm_async" in message else []
    engine += ["train.trainer=ppo"] if "ppo samples" in message else []
    engine += ["train.trainer=online_dpo_vllm", "train.engine_backend=ray"] if "Ray's own" in message else []
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(PARAMS, "ci", [override, *engine])


@pytest.mark.parametrize("trainer", ["online_dpo", "online_dpo_vllm", "bok"])
def test_the_decoupled_objective_is_refused_where_no_policy_gradient_surrogate_exists(trainer):
    with pytest.raises(ConfigError, match="train.decoupled_cap weights policy-gradient surrogates per token") as err:
        load_config(PARAMS, "ci", [f"train.trainer={trainer}", "train.decoupled_cap=5"])
    line = str(err.value).splitlines()[-1]  # one line names the setting and why
    assert "train.decoupled_cap" in line and line.endswith(f"it applies to ppo, rloo, grpo, not {trainer}")


@pytest.mark.parametrize("trainer", ["ppo", "rloo", "grpo"])
def test_the_decoupled_objective_loads_for_the_policy_gradient_ones_but_not_beside_tis(trainer):
    cfg = load_config(PARAMS, "ci", [f"train.trainer={trainer}", "train.decoupled_cap=5", "train.engine=vllm_async"])
    assert (cfg.train.decoupled_cap, cfg.train.tis_cap) == (5.0, None)
    with pytest.raises(ConfigError, match="train.decoupled_cap and train.tis_cap are two corrections .*: set one"):
        load_config(PARAMS, "ci", [f"train.trainer={trainer}", "train.decoupled_cap=5", "train.tis_cap=2"])


def test_unknown_profile_lists_the_valid_ones():
    with pytest.raises(
        ConfigError, match="unknown profile 'nope'; valid profiles in .*: ci, pythia-tldr, smollm2, smollm2-math, tiny"
    ):
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


def test_duplicate_keys_at_any_level_are_refused_with_both_lines(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text("profile: ci\ntrain:\n  trainer: ppo\nprofiles:\n  ci: {}\ntrain:\n  k: 4\n")
    with pytest.raises(ConfigError, match=rf"{params}: duplicate key 'train' \(lines 2 and 6\): keep one"):
        load_config(params)
    params.write_text("profiles:\n  ci:\n    train:\n      k: 2\n      k: 3\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'k' \(lines 4 and 5\)"):
        load_config(params, "ci")
    with pytest.raises(ConfigError, match=r"override train: duplicate key 'k'"):
        load_config(PARAMS, "ci", ["train={k: 2, k: 3}"])


def test_the_profile_can_be_chosen_by_an_override_but_not_twice():
    assert load_config(PARAMS, None, ["profile=smollm2"]).profile == "smollm2"
    assert load_config(PARAMS, None, ["profile=smollm2"]).model.source == "smollm2"
    with pytest.raises(ConfigError, match="the profile is given twice"):
        load_config(PARAMS, "ci", ["profile=smollm2"])


@pytest.mark.parametrize(
    "text, message",
    [
        ("profile: [ci]\nprofiles: {ci: {}}\n", "unknown profile \\['ci'\\]"),
        ("profile: ci\nprofiles: [ci]\n", "profiles must be a mapping"),
        ("profile: ci\nprofiles: {ci: [train]}\n", "profiles.ci must be a mapping of sections"),
        ("profile: ci\nprofiles: {ci: {trainers: [ppo]}}\n", "profiles.ci.trainers must be a mapping"),
        ("profile: ci\nprofiles: {ci: {trainers: {ppo: 1}}}\n", "profiles.ci.trainers.ppo must be a mapping"),
        ("profile: ci\nprofiles: {ci: {}}\ntrain: 5\n", "train: Input should be a valid dictionary"),
    ],
)
def test_settings_of_the_wrong_yaml_type_name_the_key(tmp_path, text, message):
    params = tmp_path / "params.yaml"
    params.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(params)


def test_non_utf8_params_file_is_named(tmp_path):
    bad = tmp_path / "params.yaml"
    bad.write_bytes(b"profile: tiny\nseed: \xff\xfe\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(bad)


def test_cli_help_lists_the_stages():
    proc = run_cli("--help")
    assert proc.returncode == 0
    for stage in ("prepare", "gold", "sft", "reward", "train", "generate", "evaluate", "report"):
        assert stage in proc.stdout


def test_cli_bad_input_exits_non_zero_with_the_key_in_the_message():
    proc = run_cli("--profile", "ci", "config", "train.lr=1")
    assert proc.returncode == 1 and "train.lr: unknown key" in proc.stderr
    proc = run_cli("--profile", "nope", "config")
    assert proc.returncode == 1 and "valid profiles" in proc.stderr
    proc = run_cli("train", "--trainer", "nope")  # argparse: exit 2, the presets listed
    assert (
        proc.returncode == 2 and "--trainer: invalid choice: 'nope'" in proc.stderr and "online_dpo_vllm" in proc.stderr
    )
    proc = run_cli("train", "train.trainer=nope")
    assert proc.returncode == 1 and "train.trainer" in proc.stderr


def test_config_and_its_errors_answer_without_importing_torch():
    """torch is imported only once a stage runs (a minute or more on a slow box): `rlhf config` and a bad key don't."""
    probe = (
        "import sys; from rlhf.cli import main; "
        "codes = [main(['--params', sys.argv[1], '--profile', 'ci', 'config']), "
        "main(['--params', sys.argv[1], '--profile', 'ci', 'train', 'train.lr=1'])]; "
        "print(codes, 'torch' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", probe, str(PARAMS)], cwd=ROOT, capture_output=True, text=True)
    assert proc.stdout.strip().endswith("[0, 1] False"), proc.stderr[-2000:]
    assert "train.lr: unknown key" in proc.stderr


def test_the_prepare_gold_and_report_stages_run_without_importing_torch(tmp_path):
    """rlhf.cli.WITHOUT_TORCH: the three stages, run through the CLI's main on the ci profile, leave torch unimported
    (an import of torch creeping into one, directly or through a library, fails here); the report over the
    metrics of only these stages says the others have not run."""
    probe = (
        "import sys; from rlhf.cli import main; "
        "codes = [main(['--params', sys.argv[1], '--profile', 'ci', stage, 'data_dir=' + sys.argv[2]]) "
        "for stage in ('prepare', 'gold', 'report')]; "
        "print(codes, 'torch' in sys.modules)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe, str(PARAMS), str(tmp_path)], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.stdout.strip().endswith("[0, 0, 0] False"), proc.stdout[-1000:] + proc.stderr[-2000:]
    assert (tmp_path / "gold" / "judge.json").exists()
    assert "<td>train</td><td>(not run)</td>" in (tmp_path / "report" / "index.html").read_text()


def test_cli_config_prints_the_resolved_values():
    proc = run_cli("--profile", "ci", "config", "train.k=3")
    assert proc.returncode == 0 and "k: 3" in proc.stdout and "profile: ci" in proc.stdout


def test_cli_missing_inputs_name_the_file_and_the_fix(tmp_path):
    proc = run_cli("--profile", "ci", "sft", f"data_dir={tmp_path}")
    assert proc.returncode == 1 and "rlhf prepare" in proc.stderr and str(tmp_path) in proc.stderr
    proc = run_cli("--profile", "ci", "prepare", f"data_dir={tmp_path}", "data.reviews_csv=/nonexistent/reviews.csv")
    assert proc.returncode == 1 and "/nonexistent/reviews.csv" in proc.stderr
    assert not (tmp_path / "prepared").exists()  # nothing half-written


# --- one source per fact -----------------------------------------------------------------------------------


def _fields(model=Config, prefix=""):
    """(dotted name, pydantic field) of every leaf setting."""
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from _fields(field.annotation, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", field


def _leaves(values: dict, prefix=""):
    """(dotted name, value) of every leaf of a params.yaml section tree (train.lora.rank, ...)."""
    for key, value in values.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def test_every_setting_is_described_next_to_its_field():
    undescribed = [name for name, field in _fields() if not (field.description or "").strip()]
    assert undescribed == []


def test_every_setting_is_read_by_some_code():
    """A field no code reads is a knob that does nothing. A read counts only through the field's own section
    (tests/config_readers.py): `train.k` needs `<a train section>.k`, not any `.k`."""
    from config_readers import section_reads

    reads = set()
    for path in [*(ROOT / "rlhf").rglob("*.py"), *(ROOT / "flows").rglob("*.py"), *(ROOT / "tasks").rglob("*.py")]:
        if path.parent != ROOT / "rlhf" / "config":  # the schema and its loader: the validators read every field
            reads |= section_reads(path.read_text())
    for reader in (Config.path, Config.rl_seed.fget):  # data_dir's and train.seed's readers live on the schema
        reads |= section_reads(textwrap.dedent(inspect.getsource(reader)))
    unread = [name for name, _ in _fields() if name not in reads]
    assert unread == []


@pytest.mark.parametrize("profile", ["tiny", "smollm2", "smollm2-math", "pythia-tldr", "ci"])
def test_profiles_list_only_what_differs_from_the_defaults(profile):
    raw = yaml.safe_load(PARAMS.read_text())["profiles"][profile]
    fields = dict(_fields())
    per_trainer = raw.pop("trainers", {})
    restated = [name for name, value in _leaves(raw) if fields[name].default == value]
    assert restated == []
    for trainer, sections in per_trainer.items():  # a trainer's own settings differ from the profile's
        resolved = load_config(PARAMS, profile, [f"train.trainer={trainer}"]).model_dump()
        plain = load_config(PARAMS, profile).model_dump()
        assert all(resolved[s][k] != plain[s][k] for s, values in sections.items() for k in values), trainer


def test_a_profile_can_set_values_for_one_trainer():
    """pythia-tldr: PPO takes one sample per prompt as in the paper; the others keep k = 2; the user still wins."""
    assert load_config(PARAMS, "pythia-tldr", ["train.trainer=ppo"]).train.k == 1
    assert load_config(PARAMS, "pythia-tldr", ["train.trainer=rloo"]).train.k == 2
    assert load_config(PARAMS, "pythia-tldr", ["train.trainer=ppo", "train.k=4"]).train.k == 4


def test_trainer_names_come_from_the_presets():
    from rlhf.trainers.objectives import OBJECTIVES

    assert {p.algorithm for p in PRESETS.values()} == set(OBJECTIVES)
    assert {p.engine for p in PRESETS.values()} <= set(ENGINES)
    for name in PRESETS:
        assert load_config(PARAMS, "ci", [f"train.trainer={name}"]).train.trainer == name
    raw = yaml.safe_load(PARAMS.read_text())
    assert raw["train"]["trainer"] in PRESETS
    proc = run_cli("train", "--help")
    assert proc.returncode == 0
    for name, preset in PRESETS.items():  # each preset with the original system's class name
        assert re.search(rf"^\s+{name}\s+{preset.public_name}\s", proc.stdout, re.M), name


@pytest.mark.parametrize(
    "trainer, processes, accumulation, batch",
    [
        ("online_dpo", 4, 16, 512),
        ("online_dpo", 8, 8, 512),
        ("online_dpo_vllm", 3, 21, 504),
        ("online_dpo_vllm", 7, 9, 504),
    ],
)
def test_the_paper_layouts_in_docs_gpu_divide(trainer, processes, accumulation, batch):
    """docs/gpu.md's launch lines for pythia-tldr: 4 / 8 training GPUs (sync) and 3 + 1 / 7 + 1 (async)."""
    from rlhf.trainers.setup import Sizes

    overrides = [f"train.trainer={trainer}", f"train.gradient_accumulation_steps={accumulation}"]
    sizes = Sizes.derive(load_config(PARAMS, "pythia-tldr", overrides).train, processes)
    assert sizes.batch == batch and sizes.num_batches * batch == 129024
    docs = (ROOT / "docs" / "gpu.md").read_text()
    line = f"--num_processes {processes} $P train --trainer {trainer}"
    assert line in docs and (accumulation == 16 or f"gradient_accumulation_steps={accumulation}" in docs)


def test_a_batch_that_does_not_divide_over_the_training_processes_is_refused_naming_the_settings():
    """The load-time check (W = 1) passes; the trainer's setup checks again for its W, in the same words."""
    from rlhf.trainers.setup import Sizes

    c = load_config(PARAMS, "ci").train  # P*G*M = 4*1*2 prompts per rank, 16 episodes
    assert Sizes.derive(c, 2).num_batches == 1
    sizes = re.escape("P*G*M*W (W: training processes) = 4*1*2*3 = 24")
    with pytest.raises(
        ValueError, match=rf"train.total_episodes \(16\) must be divisible by the prompts per batch {sizes}"
    ):
        Sizes.derive(c, 3)
