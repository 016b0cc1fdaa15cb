"""params.yaml + a profile + `key=value` overrides -> one validated Config (rlhf.config.schema).

Resolution order, the one place it is written (later wins):
  1. the field defaults (rlhf/config/schema.py, where every field is documented);
  2. `profiles.<profile>` in params.yaml; the profile is `--profile`, else `profile` (an override or params.yaml's
     top level), else `tiny`;
  3. `profiles.<profile>.trainers.<trainer>`: the profile's settings for the run's trainer (e.g. PPO's k = 1 in
     the paper's setting); the trainer is `train.trainer` from layers 4-5, else the profile's, else online_dpo;
  4. the top-level sections of params.yaml (what `dvc exp run -S key=value` edits);
  5. `key=value` overrides from the command line (`--trainer NAME` is `train.trainer=NAME`), applied to
     params.yaml as read: `train.k=4` replaces the top-level `train.k`.
params.yaml is the single source of truth; the command line only overrides it. Unknown keys, wrong types and
impossible values fail at load time with a message naming the dotted key.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from rlhf.config.schema import Config
from rlhf.presets import PRESETS

DEFAULT_PARAMS = Path("params.yaml")


class ConfigError(ValueError):
    """A params.yaml / override problem; the message names the key or file."""


class _Loader(yaml.SafeLoader):
    """YAML 1.2 floats (PyYAML alone reads `1e-5`, no dot, as a string), and no duplicate keys: PyYAML keeps the
    last one silently, DVC calls the file corrupt, so `rlhf` and `dvc repro` would disagree about the params."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (lines {seen[key]} and {line}): keep one", key_node.start_mark
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^[-+]?(?:[0-9][0-9_]*)\.?[0-9]*(?:[eE][-+]?[0-9]+)$"
        r"|^[-+]?[0-9][0-9_]*\.[0-9_]*$"
        r"|^[-+]?\.[0-9_]+(?:[eE][-+][0-9]+)?$"
        r"|^[-+]?\.(?:inf|Inf|INF)$"
        r"|^\.(?:nan|NaN|NAN)$"
    ),
    list("-+0123456789."),
)


def parse_yaml(text: str, origin: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except yaml.constructor.ConstructorError as e:
        if e.problem and e.problem.startswith("duplicate key"):
            raise ConfigError(f"{origin}: {e.problem}") from None
        raise ConfigError(f"{origin}: malformed YAML: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{origin}: malformed YAML: {e}") from None


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def parse_override(item: str) -> tuple[list[str], Any]:
    """`section.key=value` -> (["section", "key"], value parsed as YAML; "" is null). The one parser of overrides:
    the CLI, the Prefect flow and the benchmarks all use it."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value (e.g. train.learning_rate=1e-4)")
    key, value = item.split("=", 1)
    return key.strip().split("."), parse_yaml(value, f"override {key}") if value != "" else None


def _override(raw: dict, item: str) -> dict:
    path, nested = parse_override(item)
    for part in reversed(path):
        nested = {part: nested}
    return _merge(raw, nested)


def _format_error(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        key = ".".join(str(p) for p in err["loc"]) or "(config)"
        if err["type"] == "extra_forbidden":
            lines.append(f"{key}: unknown key")
        else:
            got = "" if err["type"].startswith("value_error") else f" (got {err.get('input')!r})"
            lines.append(f"{key}: {err['msg']}{got}")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def profiles(params_path: Path | str = DEFAULT_PARAMS) -> list[str]:
    return sorted(_read_params(Path(params_path)).get("profiles") or {})


def _read_params(path: Path) -> dict:
    if not path.exists():
        raise ConfigError(f"{path}: params file not found (run from the project root or pass --params)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    raw = parse_yaml(text, str(path)) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return raw


def load_config(
    params_path: Path | str = DEFAULT_PARAMS, profile: str | None = None, overrides: list[str] = ()
) -> Config:
    """Resolve params.yaml + profile + overrides into a validated Config, in the order of this module's docstring."""
    params_path = Path(params_path)
    user = _read_params(params_path)
    for item in overrides:
        user = _override(user, item)
    if profile is not None and any(parse_override(o)[0] == ["profile"] for o in overrides):
        raise ConfigError("the profile is given twice (--profile and profile=): keep one")
    return _resolve(user, profile, params_path)


def _resolve(user: dict, profile: str | None, params_path: Path) -> Config:
    name = profile or user.pop("profile", None) or "tiny"
    user.pop("profile", None)
    base, per_trainer = _profile(user.pop("profiles", None) or {}, name, params_path)
    trainer = _section(user, "train").get("trainer") or _section(base, "train").get("trainer") or "online_dpo"
    merged = _merge(_merge(base, per_trainer.get(trainer) or {} if isinstance(trainer, str) else {}), user)
    merged["profile"] = name
    try:
        return Config.model_validate(merged)
    except ValidationError as e:
        raise ConfigError(_format_error(e)) from None


def changed_settings(cfg: Config, params_path: Path | str = DEFAULT_PARAMS) -> dict[str, tuple]:
    """{dotted key: (the profile's value, the run's value)} for what the run `cfg` (params.yaml and any overrides)
    sets on top of its profile and trainer as `params_path` defines them (the profile and the trainer themselves
    left out: a run names them on its own)."""
    params_path = Path(params_path)
    only_profile = {"profiles": _read_params(params_path).get("profiles"), "train": {"trainer": cfg.train.trainer}}
    base = flatten(_resolve(only_profile, cfg.profile, params_path).model_dump(mode="json"))
    run = flatten(cfg.model_dump(mode="json"))
    return {k: (base.get(k), v) for k, v in run.items() if base.get(k) != v and k not in ("profile", "train.trainer")}


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{"a.b": 1} from {"a": {"b": 1}}."""
    out = {}
    for key, value in tree.items():
        out.update(flatten(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


PLUMBING_PROFILES = {"ci": "a plumbing check (micro sizes, seconds per stage): its numbers are not meaningful"}


def profile_note(profile: str) -> str | None:
    """One line for a profile whose results must not be read as results (e.g. `profile ci: a plumbing check...`)."""
    return f"profile {profile}: {PLUMBING_PROFILES[profile]}" if profile in PLUMBING_PROFILES else None


def _profile(all_profiles: Any, name: Any, params_path: Path) -> tuple[dict, dict]:
    """profiles.<name> split into (its sections, its per-trainer settings), every level checked to be a mapping."""
    if not isinstance(all_profiles, dict):
        raise ConfigError(f"{params_path}: profiles must be a mapping of profile names to settings")
    if not isinstance(name, str) or name not in all_profiles:
        valid = ", ".join(sorted(all_profiles)) or "(none)"
        raise ConfigError(f"unknown profile {name!r}; valid profiles in {params_path}: {valid}")
    base = all_profiles[name] or {}
    if not isinstance(base, dict):
        raise ConfigError(f"{params_path}: profiles.{name} must be a mapping of sections")
    base = dict(base)
    per_trainer = base.pop("trainers", None) or {}
    if not isinstance(per_trainer, dict):
        raise ConfigError(f"{params_path}: profiles.{name}.trainers must be a mapping of trainer names to settings")
    for trainer, settings in per_trainer.items():
        if trainer not in PRESETS:
            raise ConfigError(f"profiles.{name}.trainers.{trainer}: unknown trainer (known: {', '.join(PRESETS)})")
        if not isinstance(settings, dict | None):
            raise ConfigError(f"{params_path}: profiles.{name}.trainers.{trainer} must be a mapping of sections")
    return base, per_trainer


def _section(raw: dict, name: str) -> dict:
    """raw[name] when it is a mapping, else {} (validation then names the section's wrong type)."""
    value = raw.get(name)
    return value if isinstance(value, dict) else {}


def fingerprint(cfg: Config) -> str:
    """A short hash of everything that decides a run's results (not where it lives or how it logs): a
    checkpoint is resumed only by a run with the same fingerprint."""
    not_results = {"data_dir": True, "tracking": True, "train": {"keep_checkpoints", "gc_every"}}
    settings = cfg.model_dump(mode="json", exclude=not_results)
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


def config_yaml(cfg: Config) -> str:
    """The resolved configuration as YAML (what `rlhf config` prints and each trained policy keeps)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
