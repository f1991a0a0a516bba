"""A pass never makes the host wait for the device (``engine/transfer.py``).

On CUDA a blocking host-to-device copy synchronises the stream: the host would wait for the pass
already queued, and the one-pass lookahead of ``Classifier.classify_passes`` would overlap nothing.
On the CPU the packed path and its scorers run on the meta device (the CUDA path's calls, no data), where
every copy from the host must be a queued one; the ``cuda`` test launches real passes under
``torch.cuda.set_sync_debug_mode("error")`` (bench/gpu.sh stage 1).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.integration.test_packed import MULTI, TEXTS, autocast_knows_meta, make, max_delta, meta, meta_qwen
from worker.engine import packed, scoring
from worker.engine.forward import PrefixKV
from worker.engine.labels import LabelTokens
from worker.engine.loader import load_model
from worker.engine.scoring import PromptScorer
from worker.engine.task import default_task
from worker.engine.transfer import upload
from worker.quality.head import Head, HeadScorer

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class BlockingUploads(TorchDispatchMode):
    """Records ops that read host tensors into meta ones, except queued copies (``non_blocking=True``)."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ins = [a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)]
        outs = out if isinstance(out, (tuple, list)) else [out]
        to_meta = any(isinstance(o, torch.Tensor) and o.device.type == "meta" for o in outs)
        if to_meta and any(a.device.type == "cpu" for a in ins) and not _queued(func, args, kwargs):
            self.seen.append(str(func))
        return out


def _queued(func, args, kwargs) -> bool:
    """A copy op (``to`` in any overload, ``_to_copy``, ``copy_``) called with ``non_blocking=True``."""
    aten = torch.ops.aten
    if func.overloadpacket not in (aten.to, aten._to_copy, aten.copy_):
        return False
    bound = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
    return bool(bound.get("non_blocking", False))


def test_the_check_sees_blocking_copies():
    """What it cannot see: tensors torch builds from Python data below the dispatcher (``torch.tensor(...,
    device=)``, a list as an index), also blocking copies on CUDA: the ``cuda`` test catches those."""
    x = meta(4, 3)
    with BlockingUploads() as blocking:
        torch.tensor([0, 1]).to("meta")
        x.index_select(1, torch.tensor([0, 2]))
    assert len(blocking.seen) == 2
    with BlockingUploads() as blocking:
        upload(torch.tensor([0, 1]), torch.device("meta"))
        x.index_select(1, upload(torch.tensor([0, 2]), torch.device("meta")))
    assert blocking.seen == []


@pytest.mark.skipif(not autocast_knows_meta(), reason="this transformers opens autocast on the meta device")
@pytest.mark.parametrize("with_prefix", [True, False])
def test_a_packed_pass_and_its_scorers_queue_every_upload(with_prefix):
    """The main packed call, mean pooling, label continuations, prompt and head scoring: no blocking copy."""
    model = meta_qwen()
    width = model.config.hidden_size
    prefix = None
    if with_prefix:
        prefix = PrefixKV(layers=tuple((meta(1, 2, 9, 16), meta(1, 2, 9, 16)) for _ in range(2)), length=9)
    # "b" and "c" share a first token and span several: continuation calls run
    tokens = LabelTokens(("a", "b", "c"), ((5,), (6, 7), (6, 8, 9)), (5, 6), (0, 1, 1), (1, 2))
    prompt = PromptScorer(model, tokens)
    z = np.zeros
    head = HeadScorer(Head(("a", "b", "c"), "mean", "logreg", z(width), z(width) + 1, z((3, width)), z(3)), "meta")
    rows = [[1, 2, 3], [4] * 40, [7], [8, 9]]
    with torch.inference_mode(), BlockingUploads() as blocking:
        fwd = packed.run_packed(model, rows, 0, prefix, keep_cache=True, mean_pool=True, kernel="flash")
        by_prompt, by_head = prompt.scores(model, fwd), head.scores(model, fwd)
    assert blocking.seen == []
    assert by_prompt.shape == by_head.shape == (4, 3) and fwd.h_mean.shape == (4, width)


def test_label_token_logprobs_in_chunks_equal_one_log_softmax(loaded_cpu, monkeypatch):
    """``token_logprobs`` bounds its logits per chunk; the numbers are log_softmax's, whatever the chunk."""
    model = loaded_cpu.model
    vocab = model.get_output_embeddings().weight.shape[0]
    hidden = torch.randn(3, 5, 2, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    targets = torch.randint(vocab, (3, 5, 2), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = torch.log_softmax(model.get_output_embeddings()(hidden).float(), -1).gather(-1, targets[..., None])
        whole = scoring.token_logprobs(model, hidden, targets)
        monkeypatch.setattr(scoring, "LOGITS_BYTES", 4 * vocab * 4)  # 4 positions per chunk: 8 chunks, one partial
        chunked = scoring.token_logprobs(model, hidden, targets)
    assert whole.shape == chunked.shape == targets.shape
    assert torch.allclose(whole, want[..., 0], atol=1e-5) and torch.allclose(chunked, want[..., 0], atol=1e-5)


@pytest.fixture(scope="module")
def loaded_cpu(tiny_model_dir):
    return load_model(str(tiny_model_dir), torch.device("cpu"), torch.float32, tiny_model_dir / "cache")


@cuda
@pytest.mark.parametrize("task", [default_task(), MULTI], ids=["default", "multi-token"])
def test_cuda_launching_passes_never_waits_for_the_device(tiny_model_dir, task):
    """fp16, flash, CUDA graphs: once every shape is captured, launching a window's passes makes no sync."""
    loaded = load_model(str(tiny_model_dir), torch.device("cuda"), torch.float16, tiny_model_dir / "cache")
    clf = make(loaded, task, attention="auto", pass_max_items=8, pass_max_tokens=4096)
    items = clf.prepare_valid(TEXTS * 3)
    passes = clf.plan(items)
    want = clf.classify(items, passes)[0]
    clf.classify(items, passes)  # second sight of every shape: captured
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        launched = [clf.launch_pass([items[i] for i in p.indices]) for p in passes]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    got = [None] * len(items)
    for p, pending in zip(passes, launched):
        for i, pred in zip(p.indices, clf.postprocess(pending.result(), [items[i] for i in p.indices])):
            got[i] = pred
    assert clf._graphs is not None and clf._graphs.enabled and clf._graphs.replays >= len(passes)
    assert max_delta(got, want) < 2e-2
