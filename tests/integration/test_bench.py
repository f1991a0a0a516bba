"""triage-bench: the modes run the real engine on the same tickets and the figures add up.

Tiny random model (fp32, CPU): every mode must give mode 1's labels exactly
(padding and the prefix cache may not change answers), token counts must follow
from the plans, and the JSON/PNG outputs must exist with the documented keys.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.graph_standin import stand_in_runner
from worker.bench import cli, workload
from worker.bench.gemm import ModelShape, computed_flops, row_flops, work_flops
from worker.engine import bucketing

N = 6


@pytest.fixture(scope="module")
def bench_doc(tiny_model_dir, tmp_path_factory):
    import torch

    out = tmp_path_factory.mktemp("bench")
    threads = torch.get_num_threads()
    # the few-shot run scores with the start-up head; under the default labels-only head prompt its prefix would hold
    # no examples: the whole task prompt keeps "the examples live in the prefix" measurable here
    saved = os.environ.get("TRIAGE_HEAD_PROMPT")
    os.environ["TRIAGE_HEAD_PROMPT"] = "task"
    try:
        rc = _run_bench(out, tiny_model_dir)
    finally:
        if saved is None:
            os.environ.pop("TRIAGE_HEAD_PROMPT", None)
        else:
            os.environ["TRIAGE_HEAD_PROMPT"] = saved
    assert rc == 0
    assert torch.get_num_threads() == threads  # the bench pins 1 thread on CPU, then restores the caller's
    return json.loads((out / "b.json").read_text()), out


def _run_bench(out, tiny_model_dir):
    return cli.main(
        _bench_args(
            tiny_model_dir,
            out / "b.json",
            *("--n", str(N), "--fixed-batch", "4", "--pass-max-items", "4", "--prompt", "both"),
            *("--sweep", "--sweep-items", "1,4", "--sweep-tokens", "4096"),
            *("--plot", str(out / "b.png"), "--profile", str(out / "profile.txt")),
        )
    )


def test_every_mode_agrees_with_sequential_and_counts_add_up(bench_doc):
    doc, _ = bench_doc
    assert doc["schema"] == "triage-bench/2"
    assert [r["prompt"] for r in doc["runs"]] == ["few-shot", "zero-shot"]
    few, zero = doc["runs"]
    assert zero["prefix_tokens"] < few["prefix_tokens"]  # the examples live in the prefix
    for run in doc["runs"]:
        modes = {m["key"]: m for m in run["modes"]}
        assert list(modes) == ["sequential", "global_pad", "arrival", "bucketed", "bucketed_cached"]
        work = sum(run["suffix_tokens"])
        prefix = run["prefix_tokens"]
        for m in modes.values():
            assert m["items"] == N
            assert m["label_agreement"] == 1.0, m["key"]
            assert m["max_abs_dprob"] < 1e-4, m["key"]
            t = m["tokens"]
            assert t["work"] == work
            assert t["computed"] >= t["real"] >= t["work"]
            assert t["computed"] == t["real"] + t["padding"]
            assert m["flops"]["computed"] >= m["flops"]["work"] > 0
        seq = modes["sequential"]
        assert seq["passes"] == N and seq["tokens"]["padding"] == 0
        assert seq["tokens"]["real"] == work + N * prefix  # the prefix is re-computed for every ticket
        glob = modes["global_pad"]
        assert glob["tokens"]["computed"] == N * glob["pad_to"] == N * (prefix + max(run["suffix_tokens"]))
        cached = modes["bucketed_cached"]
        assert cached["tokens"]["prefix_recomputed"] == 0 and cached["tokens"]["real"] == work
        assert cached["tokens"]["computed"] < modes["bucketed"]["tokens"]["computed"]
        assert modes["bucketed"]["padding_pct"] <= modes["arrival"]["padding_pct"]
        assert sum(b["items"] for b in run["buckets"]) == N
        assert [r["pass_max_items"] for r in run["sweep"]] == [1, 4]
        assert run["sweep"][0]["passes"] == N


def test_json_has_hardware_workload_gemm_and_a_png(bench_doc):
    doc, out = bench_doc
    hw = doc["hardware"]
    assert hw["device"] == "cpu" and hw["dtype"] == "fp32" and hw["cpu_cores"] >= 1 and hw["torch_threads"] == 1
    assert doc["workload"]["n"] == N and doc["workload"]["source"] == "synthetic(seed=0)"
    assert doc["gemm"]["flops_per_s"] > 0 and [s["name"] for s in doc["gemm"]["shapes"]] == [
        "q",
        "k",
        "v",
        "o",
        "gate",
        "up",
        "down",
    ]
    assert (out / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_profile_runs_mode5s_passes_after_the_timed_runs_of_the_first_prompt(bench_doc):
    doc, out = bench_doc
    prof = doc["runs"][0]["profile"]
    m5 = next(m for m in doc["runs"][0]["modes"] if m["key"] == "bucketed_cached")
    assert "profile" not in doc["runs"][1]  # one prompt is enough to see where the time goes
    assert 1 <= prof["passes"] <= min(24, m5["passes"]) and prof["kernel_launches"] == 0  # CPU: no launches
    text = (out / "profile.txt").read_text()
    assert "by own host time" in text and "aten::" in text and "by own device time" not in text


def test_flop_counts_follow_the_documented_formula(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    shape = ModelShape.from_model(model)
    emb = model.get_input_embeddings().weight.numel()
    assert (
        shape.non_embedding_params == sum(p.numel() for p in model.parameters()) - emb
    )  # tied head: not counted twice
    n, a, layers = shape.non_embedding_params, shape.attn_width, shape.layers
    # 3 suffix tokens after a 10-token cached prefix attend to 11, 12, 13 keys
    assert row_flops(shape, 3, past=10) == 2 * n * 3 + 4 * layers * a * (11 + 12 + 13)
    assert work_flops(shape, 10, [3, 1]) == row_flops(shape, 3, 10) + row_flops(shape, 1, 10)
    batch = bucketing.Pass((0, 1), (3, 1))  # the 1-token row is padded to 3
    assert computed_flops(shape, [batch], 10, cached=True) == 2 * row_flops(shape, 3, 10)
    assert computed_flops(shape, [batch], 10, cached=True, pad_to=5) == 2 * row_flops(shape, 5, 10)


def test_an_encoders_flops_count_no_embedding_table_no_pooler_and_every_attention_pair(tiny_bert_dir):
    """MiniLM's position and token-type tables (197k) and pooler (148k) were counted as per-token matmuls (3% of
    N) and its attention as causal (half the pairs): an encoder's MFU was wrong both ways."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(tiny_bert_dir)
    shape = ModelShape.from_model(model, causal=False)
    emb = model.embeddings
    tables = sum(t.weight.numel() for t in (emb.word_embeddings, emb.position_embeddings, emb.token_type_embeddings))
    pooler = sum(p.numel() for p in model.pooler.parameters())
    assert shape.non_embedding_params == sum(p.numel() for p in model.parameters()) - tables - pooler
    n, a, layers = shape.non_embedding_params, shape.attn_width, shape.layers
    assert row_flops(shape, 3) == 2 * n * 3 + 4 * layers * a * 9  # every query sees all 3 keys


def test_input_files_jsonl_and_csv(tmp_path):
    rows = [{"text": f"ticket number {i}", "label": "billing" if i % 2 else "other"} for i in range(10)]
    jl = tmp_path / "t.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    w = workload.from_file(jl, n=4, seed=1)
    assert w.n == 4 and len(set(w.texts)) == 4
    assert list(w.texts) == sorted(w.texts, key=lambda t: int(t.split()[-1]))  # sampled, kept in file order
    assert workload.from_file(jl, n=None).texts == tuple(r["text"] for r in rows)
    csv = tmp_path / "t.csv"
    csv.write_text('id,text\n1,"hello, world"\n2,\n3,second\n')
    assert workload.from_file(csv, n=None).texts == ("hello, world", "second")
    bad = tmp_path / "bad.csv"
    bad.write_text("id,body\n1,x\n")
    with pytest.raises(ValueError, match="text"):
        workload.from_file(bad, n=None)


def test_bad_arguments_exit_2_before_loading_anything(capsys):
    assert cli.main(["--modes", "7"]) == 2
    assert cli.main(["--sweep", "--sweep-items", "0"]) == 2
    assert "--modes" in capsys.readouterr().err


def test_mode6_through_redis_gives_the_same_labels(tiny_model_dir, redis_url, key_prefix):
    """Enqueue, run `python -m worker run --drain` as a subprocess, read the results stream."""
    import redis

    from worker.bench.modes import MODES, run_mode
    from worker.bench.redis_mode import run_redis
    from worker.bench.report import _ramp, redis_line
    from worker.engine.task import default_task
    from worker.settings import Settings

    settings = Settings(model=str(tiny_model_dir), device="cpu", dtype="fp32", redis_url=redis_url, window_max_items=4)
    ((_, clf),) = cli.build_classifiers(settings, [("few-shot", default_task())])
    texts = workload.synthetic(5).texts
    seq = run_mode(clf, clf.prepare_valid(list(texts)), MODES["sequential"], 4)
    out = run_redis(settings, texts, clf.dtype_name, {"sequential": seq}, timeout_s=120, namespace=key_prefix)
    assert out.get("error") is None, out.get("error")
    assert out["results"] == 5 and out["dead_lettered"] == 0 and out["worker_windows"] == 2  # windows of 4 + 1
    assert out["agreement"]["sequential"]["label_agreement"] == 1.0
    assert out["items_per_s"] > 0 and 0 < out["infer_s"] <= out["wall_s"] and 0 <= out["queue_overhead_pct"] < 100
    assert 0 < out["first_window_s"] <= out["read_s"] + out["tokenize_s"]  # one of the two windows'
    assert 0 < out["first_result_s"] <= out["done_s_p50"] <= out["wall_s"]
    assert out["cuda_graphs_start_up"] is None and "first window read + tokenized" in redis_line(out)
    assert out["window_items"] == [4, 1] and out["windows_first_pass_early"] == 0  # no lookahead on a CPU
    assert out["gpu_s"] is None and out["gpu_busy_pct"] is None and "device busy" not in redis_line(out)  # no CUDA
    assert "2 worker windows (4, 1 tickets, 0 with the first pass queued early)" in redis_line(out)
    assert _ramp([256, 512, 4096, 4096, 1888]) == "256, 512, 4096 x2, 1888" and _ramp(None) == "?"
    assert not list(redis.Redis.from_url(redis_url).scan_iter(match=key_prefix + "*"))  # cleaned up


def test_packed_mode5_with_subsampled_baselines(tiny_model_dir, tmp_path, monkeypatch):
    """The GPU script's shape of run, on the CPU: mode 5 packed over every ticket, modes 1-4 padded on the first N."""
    monkeypatch.setenv("TRIAGE_SCORER", "prompt")
    out = tmp_path / "p.json"
    rc = cli.main(
        _bench_args(
            tiny_model_dir,
            out,
            *("--n", "8", "--fixed-batch", "2", "--attention", "packed"),
            *("--sequential-n", "3", "--baseline-n", "5", "--no-interleave"),
        )
    )
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["complete"]
    assert doc["settings"]["attention"] == "packed" and doc["settings"]["attention_kernel"] == "torch"
    modes = {m["key"]: m for m in doc["runs"][0]["modes"]}
    assert modes["sequential"]["items"] == 3 and modes["sequential"]["subsample"] == 3
    for k in ("global_pad", "arrival", "bucketed"):
        assert modes[k]["items"] == 5 and modes[k]["attention"] == "padded"
    m5 = modes["bucketed_cached"]
    assert m5["items"] == 8 and m5["subsample"] is None and m5["attention"] == "packed"
    assert m5["title"].startswith("5 packed")
    assert doc["runs"][0]["cuda_graphs_warm_up"] is None  # no CUDA graphs: nothing runs before the clock
    assert m5["tokens"]["computed"] == m5["tokens"]["real"] == m5["tokens"]["work"]  # no padding, prefix not recomputed
    assert m5["label_agreement"] == 1.0 and m5["max_abs_dprob"] < 1e-5  # over the 3 tickets mode 1 ran
    clocks = m5["clocks"]
    assert len(clocks["passes"]) == m5["passes"] and clocks["gpu_s"] is None  # no device clock on the CPU
    assert sum(p["items"] for p in clocks["passes"]) == 8
    assert m5["speedup_vs_sequential"] == pytest.approx(
        m5["items_per_s"] / modes["sequential"]["items_per_s"], rel=1e-9
    )  # per-ticket rates


CAPTURE_LOG = """
import time
from worker.engine.graphs import log_captured
from worker.logs import configure_logging, get_logger
configure_logging("json", "INFO")
log_captured(tokens=256, rows=8, longest=64, max_rel_diff=0.0, capture_ms=900.0)  # start-up warm-up: before ready
time.sleep(0.02)
get_logger("triage.worker").info("worker_ready")
time.sleep(0.02)
log_captured(tokens=4096, rows=64, longest=128, max_rel_diff=1e-3, capture_ms=100.0)
log_captured(tokens=32768, rows=512, longest=256, max_rel_diff=2e-3, capture_ms=250.5)
"""


def test_mode6_counts_the_graph_captures_the_worker_logs_after_ready():
    """The worker's capture events, through the real log chain, are what mode 6 reports as capture time."""
    import subprocess
    import sys

    from worker.bench.redis_mode import graph_captures, log_events
    from worker.logs import event_ms

    proc = subprocess.run([sys.executable, "-c", CAPTURE_LOG], capture_output=True, text=True, timeout=120, check=True)
    events = log_events(proc.stderr)
    ready = event_ms(next(e for e in events if e.get("event") == "worker_ready"))
    assert ready is not None
    n, seconds = graph_captures(events, ready)
    assert (n, round(seconds, 4)) == (2, 0.3505)
    assert {"tokens", "rows", "longest", "capture_ms"} <= set(events[-1])


def test_graph_warm_up_runs_one_pass_of_each_shape_the_timed_runs_will_meet(tiny_model_dir, tmp_path, monkeypatch):
    """Where CUDA graphs replay packed passes (here a stand-in runner on the CPU: capture is CUDA only), the bench
    runs one pass per graph shape of mode 5's plan (and of the sweep's) before timing, so no capture lands inside
    a timed run."""
    from worker.assemble import build_classifier
    from worker.bench.modes import run_sweep, warm_up
    from worker.engine.graphs import shape_for
    from worker.engine.packed import Layout
    from worker.settings import Settings

    settings = Settings(
        model=str(tiny_model_dir), device="cpu", dtype="fp32", cache_dir=tmp_path, attention="packed", pass_max_items=3
    )
    clf = build_classifier(settings)
    items = clf.prepare_valid(list(workload.synthetic(40, 0).texts))
    shape = lambda idx: shape_for(Layout.build([len(items[i].ids) for i in idx]))  # noqa: E731
    planned = [shape(b.indices) for b in clf.plan(items, True)]
    assert len(set(planned)) < len(planned)  # the workload repeats shapes: one pass of each is the point
    assert warm_up(clf, items) is None  # no graphs here: the three small passes only
    launched = stand_in_runner(clf, monkeypatch)
    got = warm_up(clf, items)
    index = {id(p): i for i, p in enumerate(items)}
    shapes = [shape([index[id(p)] for p in chunk]) for chunk in launched[3:]]  # after the three small passes
    assert sorted(shapes) == sorted(set(planned)) and got["passes"] == len(shapes)

    # the sweep's caps plan other passes: one of each of their shapes first, then the timed runs
    launched.clear()
    runs, warm = run_sweep(clf, items, [(2, 10**6), (5, 10**6)], interleave=False)
    swept = {shape(b.indices) for r in runs for b in r.passes}
    shapes = [shape([index[id(p)] for p in chunk]) for chunk in launched[: warm["passes"]]]
    assert sorted(shapes) == sorted(swept) and len(launched) == warm["passes"] + sum(len(r.passes) for r in runs)


def test_host_costs_times_every_stage_of_real_windows(tiny_model_dir, redis_url):
    """scripts/host_costs.py: the worker's own functions on real windows in a real Redis, every write settled
    (it raises otherwise), every stage timed, and nothing left in Redis."""
    import importlib.util

    import redis

    from worker.settings import Settings

    path = Path(__file__).resolve().parents[2] / "scripts" / "host_costs.py"
    spec = importlib.util.spec_from_file_location("host_costs", path)
    host_costs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host_costs)
    settings = Settings(model=str(tiny_model_dir), device="cpu", dtype="fp32", attention="packed", pass_max_items=8)
    res = host_costs.measure(settings, n=24, reps=2, redis_url=redis_url)
    assert set(res["stages"]) == {k for k, _, _ in host_costs.STAGES}
    assert res["passes"] == 3 and all(s["thread_cpu_ms"] > 0 for s in res["stages"].values())
    assert "tickets/s on this host" in host_costs.report(res) and res["cpu_us_per_ticket"] > 0
    assert res["namespace"].startswith("triage-hostcosts:")
    assert not list(redis.Redis.from_url(redis_url).scan_iter(match=res["namespace"] + "*"))


def _bench_args(tiny_model_dir, out: Path, *extra: str) -> list[str]:
    return [
        "--model",
        str(tiny_model_dir),
        "--device",
        "cpu",
        "--dtype",
        "fp32",
        "--gemm-tokens",
        "32",
        "--json",
        str(out),
        "--no-progress",
        *extra,
    ]


def test_truncation_off_drops_over_long_tickets_once_and_says_so(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """TRIAGE_TRUNCATE=false: the worker dead-letters tickets over the limit, so the bench leaves them out of every
    mode (not a traceback) and the workload section says how many and why."""
    monkeypatch.setenv("TRIAGE_TRUNCATE", "false")
    monkeypatch.setenv("TRIAGE_MAX_INPUT_TOKENS", "40")
    texts = ["refund please", "word " * 120, "the app crashes", "my parcel is lost", "very long " * 80, "hi"]
    src = tmp_path / "t.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "b.json"
    assert cli.main(_bench_args(tiny_model_dir, out, "--input", str(src), "--modes", "1,3,5", "--prompt", "both")) == 0
    doc = json.loads(out.read_text())
    wl = doc["workload"]
    assert wl["n"] == 4 and wl["dropped"] == 2 and doc["settings"]["truncate"] is False
    assert wl["dropped_reasons"] == {"over the 40-token limit (truncation is off)": 2}
    assert wl["text_tokens"]["max"] <= 40 and wl["truncated"] == 0
    for run in doc["runs"]:  # every mode of every prompt ran the same 4 tickets
        assert len(run["suffix_tokens"]) == 4
        assert all(m["items"] == 4 and m["label_agreement"] == 1.0 for m in run["modes"])
    assert "2 more tickets dropped from every mode, as the worker would dead-letter them" in capsys.readouterr().out
    # nothing left to time: one line, exit 2
    src.write_text("".join(json.dumps({"text": "long " * 100}) + "\n" for _ in range(3)))
    assert cli.main(_bench_args(tiny_model_dir, tmp_path / "none.json", "--input", str(src), "--modes", "5")) == 2
    err = capsys.readouterr().err
    assert err.startswith("triage-bench: all 3 tickets would be dead-lettered") and "Traceback" not in err


def test_mode5_runs_the_workers_prefix_cache_setting(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """Mode 5 is what the worker runs: with TRIAGE_PREFIX_CACHE=false it recomputes the prefix too (mode 4 stays
    the no-cache baseline either way)."""
    monkeypatch.setenv("TRIAGE_PREFIX_CACHE", "false")
    out = tmp_path / "b.json"
    assert cli.main(_bench_args(tiny_model_dir, out, "--n", "4", "--modes", "1,4,5")) == 0
    doc = json.loads(out.read_text())
    assert doc["settings"]["prefix_cache"] is False
    (run,) = doc["runs"]
    modes = {m["key"]: m for m in run["modes"]}
    m4, m5 = modes["bucketed"], modes["bucketed_cached"]
    assert m5["prefix_cache"] is False and m5["title"] == "5 buckets, prefix cache off"
    assert m5["tokens"]["prefix_recomputed"] == 4 * run["prefix_tokens"] > 0
    assert m5["tokens"]["real"] == m5["tokens"]["work"] + 4 * run["prefix_tokens"]
    assert m4["prefix_cache"] is False and m4["title"] == "4 length buckets, no cache"
    assert m5["label_agreement"] == 1.0
    assert "prefix cache off (TRIAGE_PREFIX_CACHE=false)" in capsys.readouterr().out
    # the default: mode 5 keeps the cache
    monkeypatch.delenv("TRIAGE_PREFIX_CACHE")
    assert cli.main(_bench_args(tiny_model_dir, out, "--n", "4", "--modes", "5")) == 0
    m5 = json.loads(out.read_text())["runs"][0]["modes"][0]
    assert m5["prefix_cache"] is True and m5["tokens"]["prefix_recomputed"] == 0
    assert m5["title"] == "5 length buckets + prefix cache"


def test_mode6_is_compared_with_a_mode5_of_the_same_prefix_cache_setting(
    tiny_model_dir, redis_url, tmp_path, monkeypatch
):
    """vs_mode5 divides the Redis worker's items/s by mode 5's: both run TRIAGE_PREFIX_CACHE=false here."""
    monkeypatch.setenv("TRIAGE_PREFIX_CACHE", "false")
    out = tmp_path / "b.json"
    args = _bench_args(tiny_model_dir, out, "--n", "3", "--modes", "5", "--redis", "--redis-url", redis_url)
    assert cli.main(args) == 0
    doc = json.loads(out.read_text())
    red, m5 = doc["redis"], doc["runs"][0]["modes"][0]
    assert red.get("error") is None, red.get("error")
    assert red["prefix_cache"] is False and m5["prefix_cache"] is False
    assert red["vs_mode5"] == pytest.approx(red["items_per_s"] / m5["items_per_s"])
    assert red["agreement"]["bucketed_cached"]["label_agreement"] == 1.0


def test_the_json_keeps_the_command_line_without_the_redis_password(tiny_model_dir, tmp_path):
    """``argv`` went into the JSON as given: ``--redis-url redis://user:PASSWORD@...`` in clear in a results file."""
    out = tmp_path / "b.json"
    url = "redis://tw:Us3rPWzz@127.0.0.1:6399/0"
    assert cli.main(_bench_args(tiny_model_dir, out, "--n", "2", "--modes", "5", "--redis-url", url)) == 0
    text = out.read_text()
    assert "Us3rPWzz" not in text and "redis://tw:***@127.0.0.1:6399/0" in json.loads(text)["argv"]


def test_joined_features_count_the_lms_tokens_apart_from_the_encoders(
    tiny_model_dir, tiny_bert_dir, tmp_path, monkeypatch, capsys
):
    """TRIAGE_ENCODER: the planner's cost adds the encoder's tokens to the LM's (``Classifier.cost_length``); the
    bench's token and FLOP columns are the LM's (FLOPs at its shape), the encoder's are apart (at its shape)."""
    from transformers import AutoModel

    monkeypatch.setenv("TRIAGE_ENCODER", str(tiny_bert_dir))
    out = tmp_path / "j.json"
    assert cli.main(_bench_args(tiny_model_dir, out, "--n", "4", "--modes", "1,5")) == 0
    doc = json.loads(out.read_text())
    (run,) = doc["runs"]
    modes = {m["key"]: m for m in run["modes"]}
    m1, m5, prefix = modes["sequential"], modes["bucketed_cached"], run["prefix_tokens"]
    work = sum(run["suffix_tokens"])
    assert m5["tokens"]["real"] == m5["tokens"]["work"] == work  # the LM's ticket tokens only (was + the encoder's)
    assert m1["tokens"]["real"] == m1["tokens"]["computed"] == work + 4 * prefix
    shape = ModelShape(**doc["model"]["shape"])
    assert m1["flops"]["computed"] == sum(row_flops(shape, prefix + n) for n in run["suffix_tokens"])
    enc_shape = ModelShape(**doc["model"]["encoder_shape"])
    assert not enc_shape.causal
    assert enc_shape == ModelShape.from_model(AutoModel.from_pretrained(tiny_bert_dir), causal=False)
    e1, e5 = m1["encoder"], m5["encoder"]
    assert e1["tokens"]["real"] == e5["tokens"]["real"] > 0  # the same tickets through the encoder
    assert e1["tokens"]["computed"] == e1["tokens"]["real"]  # one ticket a pass: no padding
    assert e5["tokens"]["computed"] >= e5["tokens"]["real"]
    assert e1["flops"]["computed"] == e1["flops"]["work"] > 0
    assert "count the LM only" in capsys.readouterr().out


def test_joined_bench_classifiers_have_the_dtypes_the_worker_picks(
    tiny_model_dir, tiny_bert_dir, tmp_path, monkeypatch
):
    """TRIAGE_DTYPE=auto (fp16 here, as on a GPU) with an encoder that overflows fp16: the worker loads both in its
    fallback dtype (``assemble.backbones``). The bench pre-loaded the LM and passed it in, which turned that rule
    off: LM fp16, encoder fp32, and mode 6's worker pinned to fp16. The prompt variants share one pair of models."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    from worker.assemble import build_classifier, task_from_settings
    from worker.engine import device
    from worker.settings import Settings

    real = device.pick_dtype
    monkeypatch.setattr(device, "pick_dtype", lambda d, req="auto": torch.float16 if req == "auto" else real(d, req))
    model = AutoModel.from_pretrained(tiny_bert_dir)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(1e6)  # inf in fp16; the embeddings' LayerNorm scales it back
    model.save_pretrained(tmp_path / "bert")
    AutoTokenizer.from_pretrained(tiny_bert_dir).save_pretrained(tmp_path / "bert")
    s = Settings(model=str(tiny_model_dir), encoder=str(tmp_path / "bert"), device="cpu", cache_dir=str(tmp_path))
    worker = build_classifier(s)
    task = task_from_settings(s)  # twice: a head needs the examples (zero-shot has none)
    (_, first), (_, second) = cli.build_classifiers(s, [("few-shot", task), ("again", task)])
    assert (first.dtype_name, first.encoder.model.dtype) == (worker.dtype_name, worker.encoder.model.dtype)
    assert worker.dtype_name == "fp32"
    assert second.loaded is first.loaded and second.encoder is first.encoder  # loaded once


def test_gpu_script_runs_mode6_with_the_window_sizing_that_ships():
    """bench/gpu.sh's mode 6 ran fixed windows (the worker's default TRIAGE_WINDOW_TARGET_S, 0), while the shipped
    GPU deploy (deploy/k8s/gpu: the base's settings + its overlay) sizes them to measured work."""
    import re

    root = Path(__file__).resolve().parents[2]
    script = (root / "bench" / "gpu.sh").read_text()
    (stage,) = [line for line in script.splitlines() if "run bench-redis" in line]
    assert "TRIAGE_WINDOW_TARGET_S=$WIN_TARGET_S" in stage and "TRIAGE_WINDOW_MAX_ITEMS=$WIN" in stage
    default = re.search(r"WIN_TARGET_S=\$\{TRIAGE_WINDOW_TARGET_S:-([0-9.]+)\}", script).group(1)
    base = (root / "deploy" / "k8s" / "base" / "configmap.yaml").read_text()
    shipped = re.search(r'TRIAGE_WINDOW_TARGET_S: "([0-9.]+)"', base).group(1)
    assert float(default) == float(shipped) > 0
    assert "TRIAGE_WINDOW_TARGET_S" not in (root / "deploy" / "k8s" / "gpu" / "configmap-gpu.yaml").read_text()
