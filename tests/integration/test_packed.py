"""Packed passes + shared-prefix attention merged by log-sum-exp: exact against the padded path and the reference.

CPU runs the plain-torch varlen kernel: the same decomposition, layout, position ids and
merge as the CUDA path, with only the kernel call differing (``varlen_flash``, whose call
is checked against the installed torch's op schema on meta tensors). The tests marked
``cuda`` run the flash kernel and CUDA graphs when a GPU is present (bench/GPU_RUN.md).
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from worker.assemble import choose_scorer
from worker.engine import bucketing, varlen
from worker.engine.classifier import Classifier
from worker.engine.compat import cache_kwarg, output_cache
from worker.engine.isolation import run_passes
from worker.engine.loader import load_model
from worker.engine.results import in_input_order
from worker.engine.task import Task, default_task

TEXTS = [
    "I was charged twice for my subscription, please refund me.",
    "The app crashes when I open settings. " * 12,
    "I cannot log in",
    "x",
    "Where is my package? Tracking says in transit for ten days. Order 1234, shipped from Berlin.",
    "Thanks for the great product!",
    "Error 500 on login page " * 30,
    "refund invoice",
    "password reset email never arrives, tried three times today",
]
# "accounting"/"account_manager" share a first token with "account"-like words and span several tokens
MULTI = Task(labels=("billing", "technical", "accounting", "account_manager"))
TOL = 1e-5

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir), torch.device("cpu"), torch.float32, tiny_model_dir / "cache")


def make(loaded, task=None, **kw):
    kw.setdefault("pass_max_items", 5)
    kw.setdefault("pass_max_tokens", 900)
    return Classifier(loaded, task or default_task(), **kw)


def max_delta(a, b):
    return max(abs(x.scores[k] - y.scores[k]) for x, y in zip(a, b) for k in x.scores)


def labels(preds):
    return [p.label for p in preds]


def assert_same(a, b):
    assert labels(a) == labels(b)
    assert max_delta(a, b) < TOL


# --------------------------------------------------------------- whole engine
@pytest.mark.parametrize("task", [default_task(), MULTI], ids=["default", "multi-token"])
@pytest.mark.parametrize("prefix_cache", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_packed_equals_padded_and_reference_prompt_scoring(loaded, task, prefix_cache):
    cap = 900 if prefix_cache else 4000
    clf = make(loaded, task, prefix_cache=prefix_cache, attention="packed", pass_max_tokens=cap)
    assert clf.attention == "packed" and clf.attention_kernel == "torch"
    if task is MULTI:
        assert clf.scorer.labels.multi  # continuation tokens really are scored
    items = clf.prepare_valid(TEXTS * 2)
    packed, stats = clf.classify(items)
    padded, pstats = clf.classify(items, attention="padded")
    assert stats.passes > 1 and max(stats.pass_sizes) > 1
    assert stats.padded_tokens == stats.real_tokens  # nothing computed but real tokens
    assert pstats.padded_tokens > pstats.real_tokens
    assert_same(packed, padded)
    assert_same(packed, clf.reference(items))


def test_packed_head_scoring_mean_pools_the_ticket_tokens_only(loaded):
    """The default scorer (a centroid head on mean-pooled hidden states) gives the padded path's answers."""
    clf = make(loaded, attention="packed")
    clf = clf.with_scoring(choose_scorer(clf, SimpleNamespace(scorer="auto", head_path=None)))
    assert type(clf.scorer).__name__ == "HeadScorer" and clf.scorer.needs_mean
    items = clf.prepare_valid(TEXTS)
    assert_same(clf.classify(items)[0], clf.classify(items, attention="padded")[0])
    assert_same(clf.classify(items)[0], clf.reference(items))


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_pooled_hidden_states_match_the_padded_pass(loaded, prefix_cache):
    """h_last and h_mean themselves (not only probabilities): the pooling window is the ticket's suffix."""
    from worker.quality.features import FeatureTap, PoolOnly

    base = make(loaded, prefix_cache=prefix_cache, attention="packed")
    items = base.prepare_valid(TEXTS)
    one_pass = [bucketing.Pass(tuple(range(len(items))), tuple(base.cost_length(p) for p in items))]
    got = {}
    for attention in ("packed", "padded"):
        tap = FeatureTap(PoolOnly(base.labels))
        base.with_scoring(tap).classify(items, one_pass, attention=attention)
        got[attention] = (tap.last[0], tap.mean[0])
    for a, b in zip(got["packed"], got["padded"]):
        assert abs(a - b).max() < 1e-4 * max(1.0, abs(b).max())


def test_single_ticket_and_very_different_lengths(loaded):
    clf = make(loaded, MULTI, attention="packed", pass_max_items=64, pass_max_tokens=100_000)
    one = clf.prepare_valid(["x"])
    assert_same(clf.classify(one)[0], clf.reference(one))
    mixed = clf.prepare_valid(["x", "Error 500 on login page " * 60, "refund", "The app crashes. " * 25])
    lengths = [len(p.ids) for p in mixed]
    assert max(lengths) > 20 * min(lengths)
    packed, stats = clf.classify(mixed)
    assert stats.passes == 1  # all four in one packed pass: no padding to the longest
    assert_same(packed, clf.classify(mixed, attention="padded")[0])
    assert_same(packed, clf.reference(mixed))


def test_truncated_tickets_are_packed_at_the_limit(loaded):
    clf = make(loaded, attention="packed", max_input_tokens=24)
    items = clf.prepare_valid(TEXTS)
    assert any(p.truncated for p in items)
    assert max(len(p.ids) for p in items) == 24 + len(clf.template.tail_ids)
    packed = clf.classify(items)[0]
    assert [p.truncated for p in packed] == [p.truncated for p in items]
    assert_same(packed, clf.reference(items))


def test_results_in_input_order_and_prefix_never_mutated(loaded):
    clf = make(loaded, attention="packed")
    before = [(k.clone(), v.clone()) for k, v in clf._prefix.layers]
    items = clf.prepare_valid(TEXTS)
    whole = clf.classify(items)[0]
    alone = [clf.classify([p])[0][0] for p in items]
    assert_same(whole, alone)
    for (k0, v0), (k1, v1) in zip(before, clf._prefix.layers):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_one_pass_in_flight_yields_every_pass_once_in_order(loaded, monkeypatch):
    """CUDA's lookahead (queue pass k+1, then hand out pass k) run on the CPU: same passes, same answers."""
    clf = make(loaded, attention="packed", pass_max_items=3)
    items = clf.prepare_valid(TEXTS)
    plain = list(clf.classify_passes(items))
    launched = []
    launch = clf.launch_pass
    monkeypatch.setattr(clf, "launch_pass", lambda chunk, **kw: launched.append(len(chunk)) or launch(chunk, **kw))
    clf.lookahead = True
    gen = clf.classify_passes(items)
    first = next(gen)
    assert len(launched) == 2  # the second pass was queued before the first was handed out
    ahead = [first, *gen]
    assert [r[0] for r in ahead] == [r[0] for r in plain] and len(plain) > 2
    assert [p for r in ahead for p in r[1]] == [p for r in plain for p in r[1]]


def test_a_pass_whose_launch_fails_is_isolated_and_the_pass_queued_before_it_keeps_its_labels(loaded, monkeypatch):
    """With one pass in flight ahead, pass k+1 is launched before pass k is read back: a launch that raises (an
    out-of-memory on the largest pass) must be pass k+1's failure, not pass k's. Pass k is read back as it ran;
    only pass k+1's tickets are re-run one by one (alone, they fit)."""
    clf = make(loaded, attention="packed", pass_max_items=3, lookahead="on")
    items = clf.prepare_valid(TEXTS)
    plan = clf.plan(items)
    want = clf.classify(items, plan)[0]
    bad = plan[1].indices[0]  # a ticket of the second pass, which is launched while the first is in flight
    launch = clf.launch_pass

    def launch_or_fail(chunk, **kw):
        if len(chunk) > 1 and any(p is items[bad] for p in chunk):
            raise RuntimeError("CUDA out of memory (simulated)")
        return launch(chunk, **kw)

    monkeypatch.setattr(clf, "launch_pass", launch_or_fail)
    out = list(run_passes(clf.classify_passes, plan, items))
    assert [r.indices for r in out] == [b.indices for b in plan] and len(plan) > 2
    assert [r.split_retries for r in out] == [0, plan[1].size] + [0] * (len(plan) - 2)
    got = [None] * len(items)
    for r in out:
        for i, p in zip(r.indices, r.predictions):
            got[i] = p
    assert_same(got, want)


def test_the_next_windows_first_pass_is_queued_before_the_last_pass_is_read_back(loaded, monkeypatch):
    """The worker's lookahead across windows, run on the CPU (on CUDA: the test below)."""
    check_early_launch(make(loaded, attention="packed", pass_max_items=3, lookahead="on"), monkeypatch)


@cuda
def test_the_next_windows_first_pass_is_queued_early_on_cuda(tiny_model_dir, monkeypatch):
    """The same with CUDA's own lookahead, fp16, flash kernel and CUDA graphs (warmed up: replays are exact)."""
    loaded = load_model(str(tiny_model_dir), torch.device("cuda"), torch.float16, tiny_model_dir / "cache")
    clf = make(loaded, attention="auto", pass_max_items=3)
    assert clf.lookahead and clf.attention == "packed"
    check_early_launch(clf, monkeypatch, warm_up=2)


def check_early_launch(clf, monkeypatch, warm_up: int = 0):
    """Window B's first pass is queued from ``before_last`` while A's last pass is unread; B's call reads that
    launch back instead of launching its own, once; the answers are the same as without."""
    a, b = clf.prepare_valid(TEXTS[:5]), clf.prepare_valid(TEXTS[5:] + TEXTS[:2])
    plan_a, plan_b = clf.plan(a), clf.plan(b)
    for _ in range(warm_up):
        clf.classify(a), clf.classify(b)
    want_a, want_b = clf.classify(a)[0], clf.classify(b)[0]
    order: list[str] = []
    reads: list[tuple[float, float]] = []  # (since, done_at) of each read-back, in order
    launch = clf.launch_pass

    def spy(chunk, **kw):
        launched, n = launch(chunk, **kw), sum(e.startswith("launch") for e in order)
        order.append(f"launch{n}")
        read = launched.result

        def result(**kw):
            order.append(f"read{n}")
            out = read(**kw)
            reads.append((kw["since"], launched.done_at))
            return out

        launched.result = result
        return launched

    monkeypatch.setattr(clf, "launch_pass", spy)
    early: list = []
    out_a = list(clf.classify_passes(a, plan_a, before_last=lambda busy: early.append(clf.prelaunch(b, plan_b))))
    na, nb = len(plan_a), len(plan_b)
    assert len(early) == 1 and na > 1 and nb > 1
    assert order.index(f"launch{na}") < order.index(f"read{na - 1}")  # B's first pass queued behind A's last
    out_b = list(clf.classify_passes(b, plan_b, first=early[0]))
    # each pass's wall clock starts at the read-back before it (B's first at A's last): passes queued behind each
    # other split the wall clock instead of each counting the device time they waited through (launch.exclusive_ms)
    assert len(reads) == na + nb and all(reads[k][0] == reads[k - 1][1] for k in range(1, len(reads))), reads
    assert sum(e.startswith("launch") for e in order) == na + nb  # B's first pass was not launched again
    assert in_input_order(out_a, len(a))[0] == want_a and in_input_order(out_b, len(b))[0] == want_b
    again = list(clf.classify_passes(b, plan_b, first=early[0]))  # handed out once: this call launches its own
    assert sum(e.startswith("launch") for e in order) == na + 2 * nb and in_input_order(again, len(b))[0] == want_b
    pre = clf.prelaunch(b, plan_b)
    settings = pre.settings
    assert pre.take(dataclasses.replace(plan_b[0]), settings) is None  # an equal pass of a re-plan is another pass
    assert pre.take(plan_b[0], (settings[0], "padded", None)) is None  # launched for the packed path
    assert pre.take(plan_b[0], settings) is not None


def test_auto_is_padded_on_cpu_and_the_settings_reach_the_classifier(tiny_model_dir, monkeypatch, tmp_path):
    from worker.assemble import GPU_PASS_DEFAULTS, build_classifier, engine_options
    from worker.settings import Settings

    for name in ("TRIAGE_ATTENTION", "TRIAGE_PASS_MAX_ITEMS", "TRIAGE_PASS_MAX_TOKENS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TRIAGE_MODEL", str(tiny_model_dir))
    monkeypatch.setenv("TRIAGE_DTYPE", "fp32")
    monkeypatch.setenv("TRIAGE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRIAGE_SCORER", "prompt")
    assert build_classifier(Settings()).attention == "padded"
    monkeypatch.setenv("TRIAGE_ATTENTION", "packed")
    clf = build_classifier(Settings())
    items = clf.prepare_valid(TEXTS)
    assert clf.attention == "packed"
    assert clf.plan(items) == bucketing.plan_packed([len(p.ids) for p in items], 64, 8192)
    # on CUDA, caps left unset get the GPU defaults; caps set by the user stay
    monkeypatch.setenv("TRIAGE_PASS_MAX_ITEMS", "100")
    opts = engine_options(Settings(), torch.device("cuda"))
    assert opts.pass_max_items == 100 and opts.pass_max_tokens == GPU_PASS_DEFAULTS["pass_max_tokens"]
    assert engine_options(Settings(), torch.device("cpu")).pass_max_tokens == 8192


# ------------------------------------------------------------------- kernels
def naive_attention(q, k, v, q_lens, k_lens, causal, scale):
    """Row by row, softmax over the keys each query may see (GQA by repeat, causal bottom-right)."""
    group = q.shape[1] // k.shape[1]
    out, lse = torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0], dtype=torch.float64)
    qo = ko = 0
    for lq, lk in zip(q_lens, k_lens):
        for i in range(lq):
            keys = range(lk) if not causal else range(min(lk, i + lk - lq + 1))
            kk = k[[ko + j for j in keys]].repeat_interleave(group, 1)  # [n, H, D]
            vv = v[[ko + j for j in keys]].repeat_interleave(group, 1)
            s = torch.einsum("hd,nhd->hn", q[qo + i], kk) * scale
            lse[:, qo + i] = torch.logsumexp(s, -1)
            out[qo + i] = torch.einsum("hn,nhd->hd", s.softmax(-1), vv)
        qo, ko = qo + lq, ko + lk
    return out, lse


@pytest.mark.parametrize("cpu_flash", [True, False], ids=["cpu-flash", "matmul"])
@pytest.mark.parametrize("causal", [True, False])
def test_torch_varlen_kernel_matches_naive_attention_with_gqa(causal, cpu_flash, monkeypatch):
    monkeypatch.setattr(varlen, "CPU_FLASH", cpu_flash and varlen.CPU_FLASH)  # matmul: what CUDA's fp32 path runs
    monkeypatch.setattr(varlen, "TORCH_BLOCK_ELEMENTS", 2000)  # several blocks per length group
    torch.manual_seed(0)
    h, hkv, d = 14, 2, 16  # Qwen2.5-0.5B's head ratio
    # a zero-length row; queries fewer than keys (bottom-right); lengths in several powers of two
    q_lens, k_lens = [3, 1, 7, 0, 5, 17, 2, 6], [3, 4, 9, 0, 5, 17, 2, 30]
    q = torch.randn(sum(q_lens), h, d, dtype=torch.float64)
    k = torch.randn(sum(k_lens), hkv, d, dtype=torch.float64)
    v = torch.randn(sum(k_lens), hkv, d, dtype=torch.float64)
    cu = lambda lens: torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)  # noqa: E731
    scale = 1 / math.sqrt(d)
    out, lse = varlen.varlen_torch(q, k, v, cu(q_lens), cu(k_lens), max(q_lens), max(k_lens), causal, scale)
    want, want_lse = naive_attention(q, k, v, q_lens, k_lens, causal, scale)
    assert lse.shape == (h, q.shape[0])
    assert torch.allclose(out, want, atol=1e-5) and torch.allclose(lse.double(), want_lse, atol=1e-5)


def test_lse_merge_equals_attention_over_the_union():
    torch.manual_seed(1)
    t, h, d, p = 6, 4, 8, 5
    q, kp, vp = torch.randn(t, h, d), torch.randn(p, h, d), torch.randn(p, h, d)
    ko, vo = torch.randn(t, h, d), torch.randn(t, h, d)
    cu_t, cu_p, cu_all = (torch.tensor(x, dtype=torch.int32) for x in ([0, t], [0, p], [0, t]))
    own, own_lse = varlen.varlen_torch(q, ko, vo, cu_t, cu_t, t, t, True, 0.3)
    pre, pre_lse = varlen.varlen_torch(q, kp, vp, cu_all, cu_p, t, p, False, 0.3)
    merged = varlen.merge_lse(own, own_lse, pre, pre_lse)
    # the same as one attention over [prefix ++ own] with a causal mask shifted by the prefix
    k, v = torch.cat([kp, ko]), torch.cat([vp, vo])
    want, _ = varlen.varlen_torch(q, k, v, cu_t, torch.tensor([0, p + t], dtype=torch.int32), t, p + t, True, 0.3)
    assert torch.allclose(merged, want, atol=1e-6)


def test_flash_call_matches_the_installed_torch_op_schema():
    """Shapes and argument order of the CUDA call, on meta tensors (no GPU needed): LSE comes back [H, T]."""
    t, h, hkv, d = 37, 14, 2, 64
    q = torch.empty(t, h, d, dtype=torch.float16, device="meta")
    k = torch.empty(t, hkv, d, dtype=torch.float16, device="meta")
    cu = torch.empty(4, dtype=torch.int32, device="meta")
    out, lse = varlen.varlen_flash(q, k, k, cu, cu, 20, 20, True, 0.125)
    assert out.shape == (t, h, d) and lse.shape == (h, t) and lse.dtype == torch.float32


def test_old_flash_lse_layout_is_converted_to_rows():
    cu = torch.tensor([0, 3, 3, 7], dtype=torch.int32)  # a zero-length segment in the middle
    padded = torch.arange(3 * 2 * 5, dtype=torch.float32).view(3, 2, 5)  # [S, H, max_q]
    rows = varlen.lse_rows(padded, cu, 7)
    assert rows.shape == (2, 7)
    assert rows[:, 0].tolist() == padded[0, :, 0].tolist() and rows[:, 2].tolist() == padded[0, :, 2].tolist()
    assert rows[:, 3].tolist() == padded[2, :, 0].tolist() and rows[:, 6].tolist() == padded[2, :, 3].tolist()


class HostTraffic(TorchDispatchMode):
    """Records ops that read host (CPU) tensors into device tensors: a copy a CUDA graph cannot capture."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [a for a in [*args, *(kwargs or {}).values()] if isinstance(a, torch.Tensor)]
        outs = out if isinstance(out, (tuple, list)) else [out]
        to_meta = any(isinstance(o, torch.Tensor) and o.device.type == "meta" for o in outs)
        if to_meta and any(a.device.type == "cpu" for a in ins):
            self.seen.append(str(func))
        return out


def meta(*shape, dtype=torch.float16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def meta_qwen():
    """Qwen2.5-0.5B's attention heads (14 query, 2 K/V, 2 layers, smaller widths) on the meta device, fp16."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=300,
        hidden_size=14 * 16,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=14,
        num_key_value_heads=2,
    )
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg).to(torch.float16)
    return model.train(False)


def autocast_knows_meta() -> bool:
    """transformers 5.0 opens ``torch.autocast("meta")`` in its rotary embedding, which torch refuses; 5.17 skips
    autocast on meta. Only this meta-device check needs it, never a real device (CUDA runs it in stage 1 of gpu.sh)."""
    import inspect

    from transformers.utils import generic

    fn = getattr(generic, "maybe_autocast", None)
    return fn is None or '"meta"' in inspect.getsource(fn)


@pytest.mark.skipif(not autocast_knows_meta(), reason="this transformers opens autocast on the meta device")
@pytest.mark.parametrize("with_prefix", [True, False])
def test_packed_flash_forward_is_capture_safe(with_prefix):
    """The exact CUDA call path (flash kernel, LSE merge, the model's own layers) on the meta device.

    Meta tensors have no data: any host read of a value (.item(), a tensor in an ``if``: a sync
    during capture) raises, and any host-to-device copy shows up in ``HostTraffic``. Passing means
    the packed forward can be captured as a CUDA graph and its shapes/arguments fit torch's ops.
    """
    from worker.engine import packed

    model = meta_qwen()
    cfg = model.config
    prefix = None
    if with_prefix:
        layers = tuple((meta(9, 2, 16), meta(9, 2, 16)) for _ in range(2))
        prefix = packed.PrefixLayers(layers, 9, meta(2, dtype=torch.int32))
    call = packed.PackedCall(
        kernel="flash",
        cu_q=meta(9, dtype=torch.int32),
        max_q=64,
        prefix=prefix,
        keep_kv=True,
        cu_all=meta(2, dtype=torch.int32),
    )
    ids, pos = meta(120, dtype=torch.long), meta(120, dtype=torch.long)
    with torch.inference_mode(), HostTraffic() as traffic:
        hidden = packed.call_decoder(model, ids, pos, call)
    assert hidden.shape == (120, cfg.hidden_size)
    assert traffic.seen == []
    assert len(call.kv) == 2 and call.kv[0][0].shape == (120, 2, 16)
    with HostTraffic() as traffic:  # the check itself sees a host-to-device copy
        torch.tensor([0, 1]).to("meta")
    assert traffic.seen


def test_a_kernel_that_fails_its_self_test_is_not_used(loaded, monkeypatch):
    assert varlen.self_test("torch", torch.device("cpu"), torch.float32) is None

    def broken(q, k, v, *args):  # e.g. a flash build that answers, but wrongly
        out, lse = varlen.varlen_torch(q, k, v, *args)
        return out * 1.5, lse

    monkeypatch.setitem(varlen.KERNELS, "flash", broken)
    assert "differs" in varlen.self_test("flash", torch.device("cpu"), torch.float32)
    monkeypatch.setattr(varlen, "pick_kernel", lambda *a: "flash")
    clf = make(loaded, attention="packed")
    assert clf.attention_kernel == "torch"  # fell back: exact answers instead of wrong ones
    items = clf.prepare_valid(TEXTS[:3])
    assert_same(clf.classify(items)[0], clf.reference(items))


def test_kernel_choice():
    assert varlen.pick_kernel("auto", torch.device("cpu"), torch.float32, 64) == "torch"
    assert not varlen.flash_usable(torch.device("cpu"), torch.float16, 64)
    with pytest.raises(ValueError):
        varlen.pick_kernel("flash", torch.device("cpu"), torch.float16, 64)


# ------------------------------------------------------------ plan, shapes
def test_packed_plan_fills_passes_to_the_real_token_cap():
    lengths = [5, 300, 7, 40, 41, 900, 3, 12] * 5
    passes = bucketing.plan_packed(lengths, max_items=8, max_tokens=1000)
    assert sorted(i for p in passes for i in p.indices) == list(range(len(lengths)))
    for p in passes:
        assert p.size <= 8 and (p.real_tokens <= 1000 or p.size == 1)
    # fewest passes for the sorted run: no two neighbours could have been one pass
    for a, b in zip(passes, passes[1:]):
        assert a.size + b.size > 8 or a.real_tokens + b.real_tokens > 1000
    assert bucketing.plan_packed([2000], 8, 1000)[0].indices == (0,)  # over the budget: alone


def test_graph_shapes_are_a_small_ladder():
    from worker.engine.graphs import next_pow2, round_tokens

    sizes = {round_tokens(n) for n in range(1, 40_000)}
    assert all(round_tokens(n) >= n and round_tokens(n) - n < max(256, n // 8 + 1) for n in range(1, 40_000, 97))
    assert len(sizes) < 60
    assert next_pow2(1, 8) == 8 and next_pow2(9, 8) == 16 and next_pow2(64, 64) == 64 and next_pow2(65, 64) == 128


def test_a_pass_is_rounded_to_its_graph_shape_only_while_it_can_have_a_graph():
    """Once MAX_GRAPHS shapes are captured, a pass of another shape runs eagerly: rounding it up would only add
    tokens and empty rows. A pass of a captured shape is still rounded (it replays)."""
    from worker.engine.graphs import MAX_GRAPHS, GraphRunner, shape_for
    from worker.engine.packed import Layout

    runner = GraphRunner.__new__(GraphRunner)  # the shape bookkeeping only (capture itself is CUDA)
    runner.enabled, runner.graphs = True, {}
    layout = Layout.build([5, 70, 300])
    shape = shape_for(layout)
    assert shape != (layout.total, 3, 300)

    def rounded(r):
        out = r.layout_for(layout)
        assert (out.lengths, out.total) == (layout.lengths, layout.total)
        return (out.padded_total, out.segments, out.max_len)

    assert rounded(runner) == shape  # it may still be captured
    runner.graphs = {(256 * (i + 1), 8, 64, 0, False, "flash"): None for i in range(MAX_GRAPHS)}
    assert shape not in {k[:3] for k in runner.graphs}
    assert rounded(runner) == (layout.total, 3, 300)  # no slot left for its shape: as it is
    runner.graphs[(*shape, 0, False, "flash")] = None
    assert rounded(runner) == shape  # its shape has a graph: replayed, so rounded
    runner.enabled = False
    assert rounded(runner) == (layout.total, 3, 300)


def test_the_replay_check_sees_one_wrong_row_beside_outlier_channels():
    from worker.engine.graphs import REPLAY_TOLERANCE, replay_error

    want = torch.randn(40, 64, generator=torch.Generator().manual_seed(0)).half()
    want[0, 3] = 3000.0  # a massive activation, as Qwen's first token has
    assert replay_error(want.clone(), want) == 0.0
    assert replay_error(want * (1 + 1e-3), want) <= REPLAY_TOLERANCE  # rounding passes
    bad = want.clone()
    bad[17] = torch.randn(64, generator=torch.Generator().manual_seed(1))  # one row of garbage (a stale offset)
    assert replay_error(bad, want) > REPLAY_TOLERANCE
    assert (bad - want).abs().max() <= 2e-2 * want.abs().max()  # a tolerance on the whole pass's max let it through


# --------------------------------------------------------------- compat
def test_cache_keyword_follows_the_decoder_signature(loaded):
    class Old(torch.nn.Module):  # transformers 5.17
        def forward(self, input_ids=None, past_key_values=None, **kwargs): ...

    class New(torch.nn.Module):  # transformers 5.24
        def forward(self, input_ids=None, cache=None, **kwargs): ...

    assert cache_kwarg(Old()) == "past_key_values" and cache_kwarg(New()) == "cache"
    assert output_cache(SimpleNamespace(past_key_values="c")) == "c"
    assert output_cache(SimpleNamespace(cache="c", past_key_values=None)) == "c"


# ------------------------------------------------------------------ CUDA
@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flash_kernel_matches_torch_kernel_on_cuda(dtype):
    torch.manual_seed(0)
    h, hkv, d = 14, 2, 64
    q_lens, k_lens = [3, 1, 70, 0, 129], [3, 4, 90, 0, 129]
    dev = torch.device("cuda")
    q = torch.randn(sum(q_lens), h, d, device=dev, dtype=dtype)
    k = torch.randn(sum(k_lens), hkv, d, device=dev, dtype=dtype)
    v = torch.randn(sum(k_lens), hkv, d, device=dev, dtype=dtype)
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0)], dtype=torch.int32, device=dev)  # noqa: E731
    for causal in (True, False):
        args = (q, k, v, cu(q_lens), cu(k_lens), max(q_lens), max(k_lens), causal, 0.125)
        fo, fl = varlen.varlen_flash(*args)
        to, tl = varlen.varlen_torch(*args)
        assert (fo.float() - to.float()).abs().max() < 2e-2
        assert (fl - tl).abs().max() < 1e-2
    assert varlen.self_test("flash", dev, dtype) is None  # incl. one-token rows (max_q 1: FlashAttention's GQA swap)


@cuda
@pytest.mark.parametrize("task", [default_task(), MULTI], ids=["default", "multi-token"])
def test_cuda_packed_with_graphs_agrees_with_padded(tiny_model_dir, task):
    """fp16 on CUDA, flash + CUDA graphs: the padded path's labels except near-ties; fp32 (torch kernel): exact."""
    for dtype, tol in ((torch.float32, TOL), (torch.float16, 2e-2)):
        loaded = load_model(str(tiny_model_dir), torch.device("cuda"), dtype, tiny_model_dir / "cache")
        clf = make(loaded, task, attention="auto", pass_max_items=8, pass_max_tokens=4096)
        assert clf.attention == "packed"
        items = clf.prepare_valid(TEXTS * 3)
        packed = clf.classify(items)[0]  # first sight of each shape: eager
        again = clf.classify(items)[0]  # second: captured, checked against an eager run
        third = clf.classify(items)[0]  # then replayed
        padded = clf.classify(items, attention="padded")[0]
        assert max_delta(packed, padded) < tol and max_delta(again, packed) < tol and max_delta(third, packed) < tol
        if dtype == torch.float32:
            assert clf.attention_kernel == "torch" and labels(packed) == labels(padded)
        else:
            assert clf.attention_kernel == "flash"
            runner = clf._graphs
            assert runner is not None and runner.enabled and runner.captures >= 1 and runner.replays >= 1


def test_a_graph_is_captured_with_positions_the_model_has(tmp_path):
    """A graph's capture runs one synthetic row of the shape's longest row (rounded up to a power of two) after the
    prefix: on a model with a learned position table (GPT-2, 128 positions here) that ran past it where no real row
    does (an IndexError here, a device-side assert that ends the process on CUDA: every ticket dead-lettered). The
    capture's positions stop at the real pass's last; the capture pass runs (on the CPU, as the warm-up would)."""
    import transformers as tf

    from tests.tiny_model import build_tokenizer, scaled_up
    from worker.engine.graphs import capture_inputs, shape_for
    from worker.engine.packed import Layout, PackedCall, call_decoder, prefix_layers_of

    tok = build_tokenizer()
    torch.manual_seed(0)
    cfg = tf.GPT2Config(
        vocab_size=len(tok), pad_token_id=tok.pad_token_id, n_embd=64, n_head=4, n_layer=2, n_positions=128
    )
    scaled_up(tf.GPT2LMHeadModel(cfg)).save_pretrained(tmp_path / "gpt2")
    tok.save_pretrained(tmp_path / "gpt2")
    lm = load_model(str(tmp_path / "gpt2"), torch.device("cpu"), torch.float32, tmp_path / "cache")
    task = Task(labels=("billing", "bug", "other"), instructions="Classify the ticket.")
    clf = Classifier(lm, task, attention="packed")
    items = clf.prepare_valid(["Error 500 on login page " * 60, "short ticket", "another short one"])
    lengths = [len(p.ids) for p in items]
    tokens, rows, longest = shape_for(Layout.build(lengths))
    last = clf.prefix_length + max(lengths) - 1
    assert last < 128 <= clf.prefix_length + min(longest, tokens) - 1  # the premise: the unclamped row ran past
    ids, pos, cu = capture_inputs(tokens, rows, longest, clf.prefix_length, last, clf.pad_id, torch.device("cpu"))
    assert int(pos.max()) == last
    call = PackedCall(kernel="torch", cu_q=cu, max_q=longest, prefix=prefix_layers_of(clf._prefix))
    with torch.inference_mode():
        hidden = call_decoder(clf.model, ids, pos, call)
    assert hidden.shape[0] == tokens
