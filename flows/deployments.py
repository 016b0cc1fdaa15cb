"""`make serve`: a Prefect server on 127.0.0.1 plus one process serving the rlhf/<trainer> deployments.

    make serve                                   # UI at http://127.0.0.1:4200 (PREFECT_PORT=... to change)
    # in another terminal:
    eval "$(.venv/bin/python -m rlhf.runtime)"; export PREFECT_API_URL=http://127.0.0.1:4200/api
    prefect deployment run rlhf/ppo --watch

Ctrl-C stops the runner first (its flow runs are cancelled), then the server. Runs execute in the
directory `make serve` started from (or $RLHF_PROJECT_DIR); one at a time by default (--limit).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

HOST = "127.0.0.1"  # loopback only: the server has no authentication
DEFAULT_PORT = 4200
START_TIMEOUT = 120  # seconds the server may take to answer (RLHF_SERVER_START_TIMEOUT): over 2 min on a slow box
# The example schedule: a nightly run of the default trainer, inactive until switched on in the UI.
SCHEDULED_TRAINER = "online_dpo"
EXAMPLE_CRON = "0 3 * * *"


def deployment_name(trainer: str) -> str:
    """rlhf/<name>: trainer names are snake_case in params.yaml, deployment names kebab-case."""
    return trainer.replace("_", "-")


def deployments() -> list:
    """One deployment of the `rlhf` flow per trainer of the config schema (RunnerDeployment objects)."""
    from prefect.deployments.runner import EntrypointType
    from prefect.schedules import Cron

    from flows.rlhf_flow import TRAINERS, rlhf

    out = []
    for trainer in TRAINERS:
        schedules = [Cron(EXAMPLE_CRON, timezone="UTC", active=False)] if trainer == SCHEDULED_TRAINER else None
        out.append(
            rlhf.to_deployment(
                name=deployment_name(trainer),
                parameters={"trainer": trainer},
                schedules=schedules,
                description=f"The dvc.yaml pipeline with train.trainer={trainer}, saved as a DVC experiment.",
                tags=["rlhf", trainer],
                entrypoint_type=EntrypointType.MODULE_PATH,  # flows.rlhf_flow.rlhf, importable from any directory
            )
        )
    return out


def _port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        return s.connect_ex((HOST, port)) == 0


def start_server(port: int, log_path: Path) -> subprocess.Popen:
    """`prefect server start` in its own session, so a terminal's Ctrl-C reaches only us and we stop it last."""
    if _port_in_use(port):
        raise SystemExit(f"port {port} on {HOST} is in use (another Prefect server?); pick one with PREFECT_PORT=...")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "prefect", "server", "start", "--host", HOST, "--port", str(port)]
    with log_path.open("ab") as log:
        return subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )


def wait_healthy(api_url: str, server: subprocess.Popen, timeout: float = START_TIMEOUT) -> float:
    """Poll <api>/health until it answers 200; return the seconds it took."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if server.poll() is not None:
            raise SystemExit(f"prefect server exited with status {server.returncode} before answering")
        try:
            with urllib.request.urlopen(f"{api_url}/health", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise SystemExit(
        f"prefect server did not answer {api_url}/health within {timeout:.0f} s (on a slow machine, set "
        "RLHF_SERVER_START_TIMEOUT to more seconds)"
    )


def stop_server(server: subprocess.Popen, timeout: float = 20.0) -> None:
    """SIGTERM the server's process group (uvicorn and its services), SIGKILL whatever outlives `timeout`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:
            return
        try:
            server.wait(timeout)
            return
        except subprocess.TimeoutExpired:
            continue


def check_prefect_settings() -> None:
    """Prefect's own settings, validated here so a bad PREFECT_* variable is one line naming it, not the server's
    traceback in its log and "exited before answering" here."""
    import pydantic

    try:
        with contextlib.redirect_stderr(io.StringIO()):  # prefect's import prints the same error as a traceback
            from prefect.settings import Settings

            Settings()
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        where = _settings_variable(Settings, e.title, first["loc"])
        raise ValueError(f"Prefect setting {where}={first['input']!r}: {first['msg']}") from None


def _settings_variable(settings, model_name: str, loc: tuple) -> str:
    """The environment variable behind field `loc` of Prefect's nested settings model `model_name` (its error names
    only the model and the field): the env prefix + field name, or an alias of it that is set."""
    import pydantic

    models = [settings]
    while models:
        model = models.pop()
        if model.__name__ == model_name and loc and str(loc[0]) in model.model_fields:
            field = model.model_fields[str(loc[0])]
            names = [model.model_config.get("env_prefix", "") + str(loc[0]).upper()]
            names += [a for a in getattr(field.validation_alias, "choices", []) if isinstance(a, str)]
            return next((n for n in names if n.upper() in os.environ), names[0])
        nested = [f.annotation for f in model.model_fields.values()]
        models += [m for m in nested if isinstance(m, type) and issubclass(m, pydantic.BaseModel)]
    return ".".join(map(str, loc))


def _raise_interrupt(signum, frame):  # SIGTERM (a supervisor, a test) shuts down like Ctrl-C
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flows.deployments", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    from rlhf import runtime

    parser.add_argument(
        "--port", type=runtime.int_argument(1, 65535), default=None, help="default: $PREFECT_PORT, else 4200"
    )
    parser.add_argument(
        "--limit", type=runtime.int_argument(1), default=1, help="flow runs at once (default 1: a run uses the CPU)"
    )
    args = parser.parse_args(argv)
    try:
        args.port = args.port or runtime.env_int("PREFECT_PORT", DEFAULT_PORT, minimum=1, maximum=65535)
        start_timeout = runtime.env_int("RLHF_SERVER_START_TIMEOUT", START_TIMEOUT, minimum=1)
    except ValueError as e:
        parser.error(str(e))  # one line, exit 2

    runtime.configure()  # offline, quiet, PREFECT_HOME=.cache/prefect: before prefect reads its settings
    api_url = f"http://{HOST}:{args.port}/api"
    # Before prefect is imported (check_prefect_settings imports it): prefect reads its settings once, and without an
    # API URL `serve` started a temporary server of its own on another port, against the same database.
    os.environ["PREFECT_API_URL"] = api_url
    try:
        check_prefect_settings()
    except ValueError as e:
        parser.error(str(e))
    os.environ.setdefault("RLHF_PROJECT_DIR", os.getcwd())
    log_path = Path(os.environ["PREFECT_HOME"]) / "server.log"
    server = start_server(args.port, log_path)
    print(f"prefect server pid {server.pid}, log {log_path}", flush=True)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started with SIGINT ignored (`cmd &`)
    try:
        took = wait_healthy(api_url, server, start_timeout)
        print(f"prefect server up in {took:.1f} s: UI http://{HOST}:{args.port}  API {api_url}", flush=True)
        print(f"trigger a run:  PREFECT_API_URL={api_url} prefect deployment run rlhf/ppo", flush=True)
        from prefect import serve

        serve(*deployments(), limit=args.limit)
    except KeyboardInterrupt:
        pass
    finally:
        print("stopping the prefect server...", flush=True)
        stop_server(server)
        print("stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
