"""CUDA graphs for packed passes: a few fixed shapes, each captured once and replayed.

An eager forward of a 0.5B decoder is ~400 kernel launches from Python; replaying a
captured graph is one. Packed passes have three sizes that vary (tokens, rows, longest
row), so each is rounded up to a small ladder of values (``shape_for``): tokens to a
step of about 1/8 of their power of two (<= 12.5% extra tokens, which are outside every
row and cost only their MLP work), rows and longest row to powers of two (extra rows
are empty: zero-length segments). A new shape is captured the second time a pass of it
runs (``Sightings``): capturing and checking costs about four forwards of that pass, which
a shape met once (a drain's last, partial pass) never pays back; its first pass runs
eagerly. Warm-ups, which run each shape once to replay it later, capture at first sight.

Every capture is checked before it is trusted: the graph is captured on a synthetic
layout, then replayed on the real pass and compared with an eager run of that pass.
A mismatch (a value baked into the graph) or any capture error turns graphs off for
this process with a warning; answers never depend on graphs working.
CUDA only: nothing here runs on CPU or MPS.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from worker.engine.packed import Layout, PackedCall, call_decoder
from worker.engine.transfer import staged

log = logging.getLogger("triage.engine")

MAX_GRAPHS = 32  # distinct shapes captured per classifier; later new shapes run eagerly
# A graph keeps its outputs (hidden states, kept K/V) for good: no new capture below this share of free memory,
# so graphs never crowd out the eager passes (a 32k-token graph with kept K/V is ~0.4-0.8 GB at 0.1-0.5B).
MIN_FREE_FRACTION = 0.2
CAPTURE_AT_SIGHT = 2  # a new shape is captured on its second pass (the first runs eagerly)
CAPTURED_EVENT = "cuda_graph_captured"
# A replay may differ from its eager pass by rounding only (the same kernels); a value baked into the graph
# (a stale length or offset) puts whole rows off by ~100%.
REPLAY_TOLERANCE = 1e-2


@dataclass
class Sightings:
    """When a shape not captured yet is worth capturing: at its ``capture_at``-th pass. Pure (no CUDA)."""

    capture_at: int = CAPTURE_AT_SIGHT
    seen: Counter = field(default_factory=Counter)
    eager: int = 0  # passes run eagerly because their shape was too new

    def capture_now(self, key) -> bool:
        self.seen[key] += 1
        if self.seen[key] >= self.capture_at:
            return True
        self.eager += 1
        return False

    @contextmanager
    def at_first_sight(self) -> Iterator[None]:
        """Capture every new shape at once while inside (warm-ups: each shape runs once, to be replayed later)."""
        old, self.capture_at = self.capture_at, 1
        try:
            yield
        finally:
            self.capture_at = old


def round_tokens(n: int) -> int:
    """Up to a step of 1/8 of n's power of two (at least 256): <= 12.5% extra, ~8 shapes per doubling."""
    step = max(256, (1 << max(0, n.bit_length() - 1)) // 8)
    return -(-n // step) * step


def next_pow2(n: int, low: int) -> int:
    return max(low, 1 << max(0, (n - 1).bit_length()))


def shape_for(layout: Layout) -> tuple[int, int, int]:
    """(tokens, rows, longest row) a pass is replayed at."""
    return round_tokens(layout.total), next_pow2(len(layout.lengths), 8), next_pow2(layout.max_len, 64)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor
    pos: torch.Tensor
    cu: torch.Tensor
    hidden: torch.Tensor
    kv: list
    call: PackedCall  # keeps the prefix K/V the graph reads alive


class GraphRunner:
    """Captured packed passes of one model, keyed by (shape, prefix, keep_kv, kernel)."""

    def __init__(self, model, pad_id: int):
        self.model = model
        self.pad_id = pad_id
        self.enabled = True
        self.graphs: dict[tuple, _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.captures = 0
        self.replays = 0
        self.sightings = Sightings()
        self.capture_s = 0.0  # host wall time spent capturing and checking (once per shape per process)

    def stats(self) -> dict:
        """Running totals for logs, metrics and the bench (``enabled`` false: graphs were turned off)."""
        return {
            "enabled": self.enabled,
            "captures": self.captures,
            "replays": self.replays,
            "shapes": len(self.graphs),
            "capture_s": round(self.capture_s, 3),
            "eager_new_shape": self.sightings.eager,  # passes run eagerly on their shape's first sight
        }

    def capturing_at_first_sight(self):
        """Context: new shapes are captured on their first pass (``Sightings.at_first_sight``)."""
        return self.sightings.at_first_sight()

    def layout_for(self, layout: Layout) -> Layout:
        """The pass rounded up to its graph shape, if it has or may still get a graph; else as it is (an eager
        pass gains nothing from the extra tokens and empty rows)."""
        if not self.enabled:
            return layout
        tokens, rows, longest = shape = shape_for(layout)
        if len(self.graphs) >= MAX_GRAPHS and all(key[:3] != shape for key in self.graphs):
            return layout
        return Layout(layout.lengths, layout.starts, layout.total, tokens, rows, longest)

    def run(self, layout: Layout, ids, pos, cu, prefix, keep_kv: bool, kernel: str):
        """Hidden states [tokens, H] and kept K/V of the pass by graph replay, or None (caller runs eagerly)."""
        if not self.enabled:
            return None
        key = (layout.padded_total, layout.segments, layout.max_len, id(prefix), keep_kv, kernel)
        g = self.graphs.get(key)
        if g is None:
            if len(self.graphs) >= MAX_GRAPHS or not self.sightings.capture_now(key) or not _room():
                return None
            t0 = time.perf_counter()
            try:
                g = self._capture(layout, ids, pos, cu, prefix, keep_kv, kernel, t0)
            except Exception as e:  # noqa: BLE001 -- any capture failure means: run eagerly
                self._disable(f"capture failed: {type(e).__name__}: {e}")
                return None
            finally:
                self.capture_s += time.perf_counter() - t0
            if g is None:
                return None
            self.graphs[key] = g
            return g.hidden, g.kv
        self._load(g, ids, pos, cu)
        g.graph.replay()
        self.replays += 1
        return g.hidden, g.kv

    def _load(self, g: _Graph, ids, pos, cu) -> None:
        """The pass's host tensors into the graph's static inputs, queued (from pinned memory: ``transfer``)."""
        for dst, src in ((g.ids, ids), (g.pos, pos), (g.cu, cu)):
            dst.copy_(staged(src, dst.device), non_blocking=True)

    def _capture(self, layout: Layout, ids, pos, cu, prefix, keep_kv: bool, kernel: str, t0: float) -> _Graph | None:
        """``t0``: when ``run`` started this capture (one clock for ``capture_s`` and the logged ``capture_ms``)."""
        dev = self.model.device
        tokens, rows, longest = layout.padded_total, layout.segments, layout.max_len
        past = prefix.length if prefix is not None else 0
        st_ids, st_pos, st_cu = capture_inputs(tokens, rows, longest, past, int(pos.max()), self.pad_id, dev)
        call = PackedCall(kernel=kernel, cu_q=st_cu, max_q=longest, prefix=prefix, keep_kv=keep_kv)

        def fwd() -> torch.Tensor:
            return call_decoder(self.model, st_ids, st_pos, call)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(side):
                fwd()  # warm-up outside the capture (allocator, cuBLAS handles, lazy inits)
                with _syncs_raise():  # what would break the capture (a host sync) raises here, before it starts
                    fwd()
        finally:  # also when a warm-up raised: its queued kernels still read st_* (freed to this stream's pool)
            torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        hidden = self._record(graph, fwd)
        g = _Graph(graph, st_ids, st_pos, st_cu, hidden, list(call.kv), call)
        self.captures += 1
        # check: the real pass by replay == the real pass eagerly
        eager_call = PackedCall(kernel=kernel, cu_q=cu.to(dev), max_q=longest, prefix=prefix)
        want = call_decoder(self.model, ids.to(dev), pos.to(dev), eager_call)[: layout.total]
        self._load(g, ids, pos, cu)
        graph.replay()
        err = replay_error(g.hidden[: layout.total], want)
        if not err <= REPLAY_TOLERANCE:
            why = "the pass's hidden states are not finite (an fp16 overflow?)" if math.isnan(err) else "differs"
            self._disable(f"replay {why}: relative error {err:.3g} against the eager pass (> {REPLAY_TOLERANCE})")
            return None
        # the check ended with a host sync (.item()): capture_ms is the capture's whole cost
        log_captured(tokens=tokens, rows=rows, longest=longest, max_rel_diff=err, capture_ms=_ms(t0))
        return g

    def _record(self, graph, fwd) -> torch.Tensor:
        """``fwd`` captured into ``graph``; its output. If the capture's end fails, torch <= 2.11 leaves the
        allocator routing this thread's allocations to the graph pool (a later free then aborts the process,
        pytorch#180395) and the thread on the capture stream: both are undone before the error goes on."""
        stream = torch.cuda.current_stream()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                return fwd()
        except BaseException:
            end = getattr(torch._C, "_cuda_endAllocateToPool", None)
            if end is not None:
                with contextlib.suppress(Exception):  # raises if the capture's end did it already
                    end(torch.cuda.current_device(), self.pool)
            torch.cuda.set_stream(stream)
            raise

    def _disable(self, why: str) -> None:
        log.warning("CUDA graphs off for this process, packed passes run eagerly: %s", why)
        self.enabled = False
        self.graphs.clear()


@contextmanager
def _syncs_raise() -> Iterator[None]:
    """Inside, an op that synchronises the host with the device raises (as it would break a capture)."""
    before = torch.cuda.get_sync_debug_mode()  # a caller's own "error" (tests/integration/test_uploads.py) stays
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


def _room() -> bool:
    """Enough free device memory for another graph's outputs (``MIN_FREE_FRACTION``; the allocator's cached,
    unused blocks count as free)."""
    free, total = torch.cuda.mem_get_info()
    cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    return free + cached >= MIN_FREE_FRACTION * total


def replay_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest relative difference of one token's hidden state, replay against eager: ``|got - want| / |want|``
    per token ([tokens, H]). Per token, because a few outlier channels (Qwen's massive activations) would make any
    tolerance on the whole pass's largest value blind to a row of garbage elsewhere."""
    got, want = got.float(), want.float()
    return ((got - want).norm(dim=-1) / want.norm(dim=-1).clamp(min=1e-6)).max().item()


def log_captured(**fields) -> None:
    """One ``cuda_graph_captured`` event per shape: the bench's Redis mode sums ``capture_ms`` from the worker's log."""
    log.info(CAPTURED_EVENT, extra=fields)


def _ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1000, 1)


def capture_inputs(
    tokens: int, rows: int, longest: int, past: int, last_position: int, pad_id: int, device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The static inputs a graph is captured with: one row of ``longest`` tokens (or fewer), the rest empty (the
    replay loads the real pass's). Positions stop at ``last_position``, the real pass's last: a row of ``longest``
    tokens after ``past`` may run past a learned position table (GPT-2's 1,024) that no real row reaches, an index
    error on the CPU and a device-side assert, fatal to the process, on CUDA."""
    first = min(longest, tokens)
    ids = torch.full((tokens,), pad_id, dtype=torch.long, device=device)
    pos = torch.zeros(tokens, dtype=torch.long, device=device)
    pos[:first] = (torch.arange(first, device=device) + past).clamp(max=last_position)
    cu = torch.tensor([0] + [first] * rows, dtype=torch.int32, device=device)
    return ids, pos, cu
