"""A pass queued on the device, with its clocks: what ``Classifier.launch_pass`` hands back."""

from __future__ import annotations

import time

import numpy as np
import torch


class LaunchedPass:
    """A pass queued on the device, with its clocks.

    ``host_ms``: host time spent launching it (token stream, Python, kernel launches or graph
    replay). ``gpu_ms`` (CUDA only): device time from the pass's first device work (``mark``, after
    the host-side preparation) to its scores landing in host memory, from CUDA events; device time
    waiting for the host's launches inside that span counts, time before it does not.
    ``wall_ms``: launch start until its scores are on the host; on CUDA, from the later of its launch
    and the read-back of the pass queued before it (``result(since=)``). Passes queued behind each
    other then split the main thread's time from the first launch to the last read-back between
    them (the host's work between read-backs included), instead of counting the same device time
    twice; ``gpu_ms`` is the device's own share.
    ``done_at``: ``perf_counter`` when its scores were on the host.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.gpu_ms: float | None = None
        self.host_ms = self.wall_ms = 0.0
        self.done_at = 0.0
        self._marked = False
        self.extra_tokens = 0
        if self.cuda:
            self._start, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self._t0 = time.perf_counter()

    def mark(self, extra_tokens: int = 0) -> None:
        """The host has prepared the pass; its device work is queued from here on. ``extra_tokens``: what the
        pass computes beyond its real tokens (a packed pass laid out at a CUDA graph's rounded shape)."""
        if self.cuda and not self._marked:
            self._start.record()
        if not self._marked:
            self.extra_tokens = extra_tokens
        self._marked = True

    def finish_launch(self, scores: torch.Tensor) -> LaunchedPass:
        self.mark()  # a path that never called it: the span is then only the host copy
        if self.cuda:
            self._host = torch.empty(scores.shape, dtype=scores.dtype, pin_memory=True)
            self._host.copy_(scores, non_blocking=True)
            self._end.record()
        else:
            self._host = scores.cpu()
        self.host_ms = (time.perf_counter() - self._t0) * 1000
        self._done = not self.cuda
        if self._done:
            self.wall_ms = self.host_ms
            self.done_at = self._t0 + self.host_ms / 1000
        return self

    def busy(self) -> bool:
        """The device is still working on this pass (CUDA only: elsewhere a launched pass has run)."""
        return self.cuda and not self._done and not self._end.query()

    def result(self, since: float = 0.0) -> np.ndarray:
        """The scores on the host, waiting for the device; ``since``: when the pass before it was read back."""
        if not self._done:
            self._end.synchronize()
            self.gpu_ms = self._start.elapsed_time(self._end)
            self.done_at = time.perf_counter()
            self.wall_ms = exclusive_ms(self._t0, since, self.done_at)
            self._done = True
        return self._host.numpy()


def exclusive_ms(launched_at: float, since: float, done_at: float) -> float:
    """A pass's share of the wall clock: from its launch, or the previous pass's read-back if that came
    later (it was queued behind it), to its own read-back. Consecutive passes' shares never overlap."""
    return (done_at - max(launched_at, since)) * 1000


class Prelaunched:
    """A plan's first pass, queued ahead of its ``classify_passes`` call (``Classifier.prelaunch``).

    The worker queues the next window's first pass while the current window's last one is on the
    device, so the device has work across the boundary. ``take`` hands the launch to the one call
    that runs this very pass with the same settings, once; any other call launches its own.
    """

    def __init__(self, first, launched: LaunchedPass, settings: tuple):
        self.first = first  # the bucketing.Pass it ran (identity: a re-planned pass is another pass)
        self.launched: LaunchedPass | None = launched
        self.settings = settings  # (prefix cache, attention, pad_to) it was launched with

    def take(self, first, settings: tuple) -> LaunchedPass | None:
        if first is not self.first or settings != self.settings:
            return None
        launched, self.launched = self.launched, None
        return launched
