"""Pipeline stages: each module has `run(cfg: Config) -> dict` (its metrics), called by `rlhf <stage>`."""
