"""What a packed pass is charged for when the CUDA-graph runner laid it out at its rounded shape.

``graphs.shape_for`` rounds a pass's tokens up (<= 12.5%) for a graph; the forward then computes the rounded count,
graph replay or eager. ``results.pass_cost`` charged the real tokens only, so padding, computed tokens and HFU read
as if no token were added. ``run_packed`` now hands the extra tokens to the pass's timer (``on_device``), and the
cost adds them. Real packed forwards on CPU; the runner's rounding is a stand-in (``layout_for``, capture is CUDA
only).
"""

from __future__ import annotations

import torch

from tests.tiny_model import build_tiny_model
from worker.engine import results
from worker.engine.bucketing import Pass
from worker.engine.graphs import shape_for
from worker.engine.launch import LaunchedPass
from worker.engine.packed import Layout, run_packed


class _Rounds:
    """A runner that lays passes out at their graph shape and replays nothing (the eager branch runs it)."""

    def layout_for(self, layout: Layout) -> Layout:
        return Layout.build(layout.lengths, *shape_for(layout))

    def run(self, *args):
        return None


def _cost(b: Pass, launched: LaunchedPass, packed: bool = True):
    return results.pass_cost(b, launched, 0.0, packed=packed, pad_to=None, prefix_tokens=0)


def test_a_pass_laid_out_at_a_rounded_shape_is_charged_the_rounded_tokens(tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "m")).eval()
    rows = [[5] * 300, [6] * 200, [7] * 100]
    b = Pass((0, 1, 2), (300, 200, 100))
    rounded = shape_for(Layout.build(b.lengths))[0]
    assert rounded > b.real_tokens  # the premise: the graph shape adds tokens
    for runner, charged in ((_Rounds(), rounded), (None, b.real_tokens)):  # eager, no runner: the real ones
        launched = LaunchedPass(torch.device("cpu"))
        run_packed(model, rows, 0, None, keep_cache=False, mean_pool=False, runner=runner, on_device=launched.mark)
        launched.finish_launch(torch.zeros(3, 2))
        stats = _cost(b, launched)
        assert (stats.real_tokens, stats.padded_tokens) == (b.real_tokens, charged)
        assert _cost(b, launched, packed=False).padded_tokens == 900  # a padded pass: its rows at their widest


def test_the_first_mark_of_a_launch_holds_its_extra_tokens():
    """``finish_launch`` marks again (a path that never did): that must not reset what the forward reported."""
    launched = LaunchedPass(torch.device("cpu"))
    launched.mark(37)
    launched.finish_launch(torch.zeros(1, 2))
    assert launched.extra_tokens == 37
