"""Typed configuration for every stage, loaded from params.yaml: the schema (schema.py: the sections and their
fields) and the loader (loader.py: params.yaml, profiles and overrides; its docstring holds the resolution order).

Importers use `from rlhf.config import X`; these are the names they use.
"""

from rlhf.config.loader import (
    DEFAULT_PARAMS,
    ConfigError,
    changed_settings,
    config_yaml,
    fingerprint,
    flatten,
    load_config,
    parse_override,
    profile_note,
    profiles,
)
from rlhf.config.schema import (
    Config,
    DataConfig,
    EvalConfig,
    GoldConfig,
    LoraConfig,
    ModelConfig,
    RewardConfig,
    SFTConfig,
    TrackingConfig,
    TrainConfig,
)

__all__ = ["DEFAULT_PARAMS", "ConfigError", "changed_settings", "config_yaml", "fingerprint", "flatten"]
__all__ += ["load_config", "parse_override", "profile_note", "profiles"]
__all__ += ["Config", "DataConfig", "EvalConfig", "GoldConfig", "LoraConfig", "ModelConfig", "RewardConfig"]
__all__ += ["SFTConfig", "TrackingConfig", "TrainConfig"]
