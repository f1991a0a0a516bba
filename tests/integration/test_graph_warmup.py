"""Start-up capture of full-pass CUDA graphs (``engine/graph_warmup.py``).

On the CPU: the shapes listed are the ones the planner's full passes meet on a long-tailed workload, each
synthetic pass replays at its shape, and the warm-up runs one pass per shape through the classifier's own
path (a stand-in runner: capture is CUDA only). The ``cuda`` test captures for real (bench/gpu.sh stage 1).
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from tests.graph_standin import stand_in_runner
from tests.integration.test_packed import TEXTS, make
from worker.bench import workload
from worker.engine.graph_warmup import full_pass_shapes, lengths_for, warm_up
from worker.engine.graphs import Sightings, shape_for
from worker.engine.loader import load_model
from worker.engine.packed import Layout
from worker.engine.verify import verify

GPU_CAPS = {"pass_max_items": 2048, "pass_max_tokens": 32768}  # assemble.GPU_PASS_DEFAULTS
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir), torch.device("cpu"), torch.float32, tiny_model_dir / "cache")


def _shape(items, indices):
    return shape_for(Layout.build([len(items[i].ids) for i in indices]))


def test_the_listed_shapes_are_those_of_the_planners_full_passes(loaded):
    """Windows of 4,096 long-tailed tickets under the GPU caps: every pass the token cap filled has a listed shape."""
    clf = make(loaded, attention="packed", **GPU_CAPS)
    items = clf.prepare_valid(list(workload.synthetic(12_288, 0).texts))
    listed = set(full_pass_shapes(GPU_CAPS["pass_max_tokens"], GPU_CAPS["pass_max_items"], clf.framing.max_row))
    full, partial = set(), set()
    for start in range(0, len(items), 4096):
        window = items[start : start + 4096]
        for p in clf.plan(window):
            full_pass = p.real_tokens > GPU_CAPS["pass_max_tokens"] - clf.framing.max_row
            (full if full_pass else partial).add(_shape(window, p.indices))
    assert len(full) >= 5 and full <= listed  # the ladder covers what a busy worker runs
    assert len(listed) <= 12  # and stays small: ~4 forwards of a full pass each, at start-up


@pytest.mark.parametrize("max_tokens, max_items, max_row", [(32768, 2048, 530), (4096, 256, 300), (512, 16, 120)])
def test_each_synthetic_pass_replays_at_its_shape_within_the_caps(max_tokens, max_items, max_row):
    made = 0
    for shape in full_pass_shapes(max_tokens, max_items, max_row):
        lengths = lengths_for(shape, max_row, max_items)
        if lengths is None:
            continue
        made += 1
        assert shape_for(Layout.build(lengths)) == shape
        assert len(lengths) <= max_items and max(lengths) <= max_row
    assert made >= 3


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_warm_up_runs_one_synthetic_pass_per_listed_shape(loaded, monkeypatch, prefix_cache):
    """Without the prefix cache every row carries the prompt prefix: the synthetic tickets are that much shorter,
    so the rows the forward sees, prefix included, still have the listed shapes."""
    caps = {"pass_max_items": 16, "pass_max_tokens": 512 if prefix_cache else 8192}  # rows of ~300+ tokens uncached
    clf = make(loaded, attention="packed", prefix_cache=prefix_cache, **caps)
    items = clf.prepare_valid(TEXTS)
    before = clf.classify(items)[0]
    assert warm_up(clf) is None  # no CUDA graphs on the CPU: nothing runs
    launched = stand_in_runner(clf, monkeypatch)
    got = warm_up(clf)
    carried = 0 if prefix_cache else clf.prefix_length
    o, max_row = clf.options, clf.framing.max_row + carried
    listed = full_pass_shapes(o.pass_max_tokens, o.pass_max_items, max_row)
    want = [s for s in listed if (n := lengths_for(s, max_row, o.pass_max_items)) and min(n) > carried]
    shapes = [shape_for(Layout.build([len(p.ids) + carried for p in chunk])) for chunk in launched]
    assert sorted(shapes) == sorted(want) and got["passes"] == len(want) >= 2
    assert clf.classify(items)[0] == before  # the synthetic passes leave no trace in real answers


def test_a_failing_warm_up_is_logged_and_the_start_goes_on_without_it(monkeypatch):
    """Only a speed-up: ``warm_graphs`` logs why and hands back no warm-up instead of raising, so the start goes on,
    capturing shapes as they come. (No CUDA here: the warm-up's failure is raised by hand, in-process.)"""
    from worker import model_start
    from worker.engine import graph_warmup

    def oom(clf):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(graph_warmup, "warm_up", oom)
    warned = []
    log = SimpleNamespace(warning=lambda event, **kw: warned.append((event, kw)))
    assert model_start.warm_graphs(object(), log) is None
    assert warned and warned[0][0] == "cuda_graph_warm_up_failed" and "out of memory" in warned[0][1]["error"]


def test_a_new_shape_is_captured_when_it_comes_back():
    """A shape met once (a drain's last pass) runs eagerly instead of paying ~4 forwards to be captured."""
    seen = Sightings()
    assert [seen.capture_now("a"), seen.capture_now("b"), seen.capture_now("a")] == [False, False, True]
    assert seen.eager == 2
    with seen.at_first_sight():  # warm-ups
        assert seen.capture_now("c")
    assert not seen.capture_now("d") and seen.capture_at == 2


def test_verify_checks_the_answers_cuda_graphs_give(loaded, monkeypatch):
    """The worker captures a shape when it comes back; verify captures at first sight, so on CUDA every batched
    answer it checks is a graph replay's (the reference runs outside)."""
    clf = make(loaded, attention="packed")
    items = clf.prepare_valid(TEXTS)
    ids = [str(i) for i in range(len(items))]
    report = verify(clf, items, ids)
    assert report.cuda_graph_passes is None and report.agreement_pct == 100.0  # CPU: no graphs; fp32: exact
    inside = [False]

    @contextmanager
    def first_sight():
        inside.append(True)
        yield
        inside.append(False)

    launched = stand_in_runner(clf, monkeypatch, first_sight=first_sight, record=lambda chunk: inside[-1])
    report = verify(clf, items, ids)
    n = report.passes  # the batched passes, then one reference pass per ticket
    assert launched[:n] == [True] * n and not any(launched[n:]) and n > 1 and len(launched) == n + len(items)
    assert report.cuda_graph_passes == 0 and report.agreement_pct == 100.0


@cuda
def test_cuda_warm_up_captures_full_passes_before_the_first_window(tiny_model_dir):
    loaded = load_model(str(tiny_model_dir), torch.device("cuda"), torch.float16, tiny_model_dir / "cache")
    clf = make(loaded, attention="auto", pass_max_items=64, pass_max_tokens=2048)
    assert clf.attention == "packed" and clf.attention_kernel == "flash"
    got = warm_up(clf)
    runner = clf.graph_runner()
    assert runner is not None and runner.enabled and got["captures"] == runner.captures == got["passes"] >= 3
    warm = {key[:3] for key in runner.graphs}  # (tokens, rows, longest) of each captured graph
    items = clf.prepare_valid(list(workload.synthetic(600, 0).texts))
    shapes = Counter(_shape(items, p.indices) for p in clf.plan(items))
    hits = sum(n for s, n in shapes.items() if s in warm)
    new = {s: n for s, n in shapes.items() if s not in warm}
    assert hits and new  # this workload meets both (worked out on the CPU: the plan does not depend on the device)
    clf.classify(items)  # warm shapes replay; a new one runs eagerly, is captured on its second pass, then replays
    assert runner.sightings.eager == len(new)
    assert runner.captures == got["captures"] + sum(n >= 2 for n in new.values())
    assert runner.replays == hits + sum(max(0, n - 2) for n in new.values())
    clf.classify(items)  # every new shape came back: all captured now
    assert runner.captures == got["captures"] + len(new) and runner.enabled


FAILED_CAPTURE = """
import torch
from worker.engine.graphs import GraphRunner

runner = GraphRunner.__new__(GraphRunner)  # only its pool: the capture itself is what is tested
runner.pool = torch.cuda.graph_pool_handle()
stream = torch.cuda.current_stream()
x = torch.ones(4, device="cuda")
try:
    runner._record(torch.cuda.CUDAGraph(), lambda: (x * 2).sum().item())  # a host sync breaks the capture
except Exception as e:
    print("capture failed:", type(e).__name__)
else:
    raise SystemExit("the capture did not fail")
assert torch.cuda.current_stream() == stream, "left on the capture stream"
for _ in range(3):  # allocations and frees after it, then what aborted on torch <= 2.11 (pytorch#180395)
    y = torch.randn(1 << 22, device="cuda") * 2
    del y
torch.cuda.synchronize()
torch.cuda.empty_cache()
print("eager work goes on")
"""


@cuda
def test_cuda_a_failed_capture_leaves_the_process_able_to_run_eagerly():
    """Graphs are turned off after a failed capture and passes run eagerly: the allocator and the current stream
    must be as before it. In a process of its own: on a broken allocator the interpreter aborts."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-c", FAILED_CAPTURE], cwd=repo, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "eager work goes on" in run.stdout, (run.stdout + run.stderr)[-2000:]
