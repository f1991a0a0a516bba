"""The shape of the code.

Pure modules import no torch, no import cycles, the engine's imports, settings through child environments.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Modules that must import without torch or transformers (parsing, planning, settings, wire format).
PURE = (
    "worker.engine.types",
    "worker.engine.bucketing",
    "worker.engine.overhead",
    "worker.engine.constants",
    "worker.engine.task",
    "worker.stream.messages",
    "worker.stream.records",
    "worker.stream.metrics",
    "worker.stream.window",
    "worker.engine.isolation",
    "worker.engine.pipeline",
    "worker.settings",
    "worker.settings_table",
    "worker.assemble",
    "worker.scorer_plan",
    "worker.rq_jobs",
    "worker.rqbatch.payload",
    "worker.ticket_files",
    "worker.bench.workload",
    "worker.commands.model_flags",
    "producer.settings",
    "producer.client",
    "producer.tickets",
)
NUMPY_FREE = (
    "worker.engine.types",
    "worker.engine.pipeline",
    "worker.engine.bucketing",
    "worker.engine.overhead",
    "worker.stream.messages",
    "worker.stream.records",
    "worker.stream.metrics",
)


@pytest.mark.parametrize("module", PURE)
def test_pure_modules_import_without_torch(module):
    code = f"import sys, {module}\nprint(' '.join(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    loaded = set(out.stdout.split())
    assert not loaded & {"torch", "transformers"}, f"importing {module} loads {sorted(loaded)}"
    if module in NUMPY_FREE:
        assert "numpy" not in loaded, f"importing {module} loads numpy"


# ------------------------------------------------------------------ import graph
def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: str = "worker") -> dict[str, set[str]]:
    """module -> the ``package`` modules it imports, anywhere in the file (function bodies too)."""
    files = {_module_name(p): p for p in (REPO / package).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        deps = set()
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against this module's package
                    pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in files:  # `import worker.engine.x.y` -> the deepest module that exists
                    name = name.rpartition(".")[0]
                if name and name.split(".")[0] == package and name != mod:
                    deps.add(name)
        graph[mod] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return path[path.index(d) :] + [d]
            if d not in state and (found := visit(d)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_find_cycle_sees_imports_inside_functions():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycles_inside_worker():
    graph = import_graph()
    assert "worker.stream.reader" in graph["worker.stream.loop"]  # the graph is real
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_engine_imports_nothing_from_quality_settings_stream_or_bench():
    forbidden = (
        "worker.quality",
        "worker.settings",
        "worker.stream",
        "worker.bench",
        "worker.assemble",
        "worker.rqbatch",
    )
    bad = {
        m: sorted(d for d in deps if d.startswith(forbidden))
        for m, deps in import_graph().items()
        if m.startswith("worker.engine")
    }
    assert not {m: d for m, d in bad.items() if d}


def test_load_model_is_called_in_one_place():
    callers = []
    for path in (REPO / "worker").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            name = getattr(node.func, "id", getattr(node.func, "attr", None)) if isinstance(node, ast.Call) else None
            if name == "load_model":
                callers.append(_module_name(path))
    assert callers == ["worker.assemble"]


def test_both_long_running_workers_start_their_model_one_way():
    """The stream and RQ batch workers serve the same passes: both warm up (and capture graphs) through start_model."""
    for rel in ("worker/stream/startup.py", "worker/rqbatch/worker.py"):
        calls = {
            getattr(node.func, "id", getattr(node.func, "attr", None))
            for node in ast.walk(ast.parse((REPO / rel).read_text(encoding="utf-8")))
            if isinstance(node, ast.Call)
        }
        assert "start_model" in calls and "build_classifier" not in calls, rel


# ------------------------------------------------- the bench runs the worker's settings
def _settings_from_env(monkeypatch, env: dict[str, str]):
    from worker.settings import Settings

    for k in [k for k in __import__("os").environ if k.upper().startswith("TRIAGE_")]:
        monkeypatch.delenv(k)
    for k, v in env.items():
        if k.startswith("TRIAGE_"):
            monkeypatch.setenv(k, v)
    return Settings()


def test_settings_survive_the_trip_through_a_child_environment(monkeypatch, tmp_path):
    from worker.settings import Settings, settings_to_env

    source = Settings(
        model=str(tmp_path / "m"),
        device="cpu",
        dtype="bf16",
        torch_threads=3,
        cache_dir=tmp_path / "c",
        labels="a,b",
        max_input_tokens=99,
        truncate=False,
        prefix_cache=False,
        window_max_items=17,
        pass_max_items=5,
        pass_max_tokens=777,
        pass_overhead_tokens=9,
        scorer="head",
        head_path=tmp_path / "h",
        calibration="contextual",
        confidence_threshold=0.25,
        fallback_label="triage_me",
        redis_url="redis://user:s3cret@example:6380/2",
        result_ttl_s=12,
        consumer="c-1",
        max_wait_ms=0,
        log_summary_s=1.5,
        prefetch=False,
        rq_allowed_callbacks="a.b,c.d",
        head_prompt="task",
        encoder="bundled:minilm",
    )
    assert _settings_from_env(monkeypatch, settings_to_env(source)).model_dump() == source.model_dump()


def test_defaults_stay_defaults_in_the_child_so_cuda_caps_apply_there(monkeypatch, tmp_path):
    """Mode 6's worker on a GPU must get the CUDA pass and window caps, as mode 5 does in the bench process:
    a default exported as an explicit value would pin the CPU caps in the child."""
    from types import SimpleNamespace

    from worker.assemble import GPU_PASS_DEFAULTS, GPU_WINDOW_MAX_ITEMS, engine_options
    from worker.assemble import window_max_items as window_cap
    from worker.settings import Settings, settings_to_env

    cuda = SimpleNamespace(type="cuda")
    here = Settings(model=str(tmp_path / "m"), pass_max_tokens=1000)
    child = _settings_from_env(monkeypatch, settings_to_env(here))
    assert child.model_dump() == here.model_dump()
    options = engine_options(child, cuda)
    assert options.pass_max_items == GPU_PASS_DEFAULTS["pass_max_items"]  # unset: the CUDA default
    assert options.pass_max_tokens == 1000  # set: kept
    assert window_cap(child, cuda) == GPU_WINDOW_MAX_ITEMS and window_cap(child, None) == child.window_max_items


def test_bench_redis_mode_worker_gets_the_bench_settings(monkeypatch, tmp_path):
    """Mode 6's subprocess reads back exactly the bench's settings, only its keys moved under the bench namespace."""
    from worker.bench.redis_mode import redis_namespace, redis_worker_env
    from worker.settings import Settings

    source = Settings(
        model=str(tmp_path / "m"),
        device="cpu",
        dtype="auto",
        torch_threads=1,
        scorer="prompt",
        head_path=tmp_path / "head.safetensors",
        calibration="contextual",
        prefix_cache=False,
        pass_max_items=3,
        pass_max_tokens=500,
        pass_overhead_tokens=11,
        window_max_items=7,
        confidence_threshold=0.4,
        task_file=tmp_path / "task.yaml",
    )
    monkeypatch.setenv("TRIAGE_SCORER", "auto")  # the bench's own environment must not leak into the child
    env = redis_worker_env(source, "ns:", "fp32")
    child = _settings_from_env(monkeypatch, env)
    assert child.model_dump() == redis_namespace(source, "ns:", "fp32").model_dump()
    moved = {
        "input_stream",
        "results_stream",
        "dead_letter_stream",
        "result_key_prefix",
        "heartbeat_key_prefix",
        "group",
        "consumer",
        "dtype",
        "log_format",
        "log_level",
    }
    for name in Settings.model_fields:
        if name not in moved:
            assert getattr(child, name) == getattr(source, name), name
    assert child.input_stream == "ns:tickets" and child.dtype == "fp32"
