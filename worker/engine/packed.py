"""Packed passes: the tickets of a pass as one unpadded token stream, sharing the prefix K/V without copies.

Layout: the rows are concatenated into one sequence of T tokens (batch 1); row s owns
tokens ``cu[s]:cu[s+1]`` and its position ids continue after the prefix. In every layer
each token's attention is computed in two parts and merged exactly by log-sum-exp (the
decomposition of Hydragen and FlashInfer's cascade attention):

  (a) over the ONE prefix K/V (batch 1, never expanded or concatenated): one dense call
      of all T queries against the P prefix keys;
  (b) causally over its own row's tokens: one varlen call over all rows.

So a pass computes exactly the real tokens (no padding) and reads the prefix once per
layer, whatever the number of tickets. The model's own code runs everything else
(projections, RoPE from the position ids, MLP); only its attention function is swapped,
through transformers' attention registry, for the duration of a packed call.

Label continuations (multi-token labels) run as a second, small packed call whose rows
are the continuation tokens; each sees the prefix, its ticket's K/V kept from the main
call, and itself (causal, bottom-right aligned).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface, PreTrainedModel

from worker.engine import varlen
from worker.engine.forward import flat_ids
from worker.engine.transfer import upload

IMPL = "triage_packed"


@dataclass
class PrefixLayers:
    """The prompt prefix's K/V per layer as [P, Hkv, D] (the varlen kernels' layout), batch 1."""

    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    length: int
    cu: torch.Tensor  # int32 [0, P]


@dataclass
class PackedCall:
    """What the attention function needs for one packed forward call (passed through the model's kwargs)."""

    kernel: str
    cu_q: torch.Tensor  # int32 [S + 1] row boundaries of the queries
    max_q: int
    prefix: PrefixLayers | None
    cu_all: torch.Tensor | None = None  # int32 [0, T]: all queries as one row (against the prefix); made by for_call
    keep_kv: bool = False
    # continuation calls: row s attends to ctx rows gathered from (kept K/V ++ this call's K/V)
    ctx_index: torch.Tensor | None = None  # long [sum of context lengths]
    cu_k: torch.Tensor | None = None
    max_k: int = 0
    base_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    kv: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # filled when keep_kv

    def attend(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
    ) -> torch.Tensor:
        # transformers hands over [1, H, T, D] views of [1, T, H, D] storage: back to [T, H, D] without a copy
        q = query[0].transpose(0, 1).contiguous()
        k = key[0].transpose(0, 1).contiguous()
        v = value[0].transpose(0, 1).contiguous()
        if self.keep_kv:
            if len(self.kv) <= layer:
                self.kv.extend([None] * (layer + 1 - len(self.kv)))  # type: ignore[list-item]
            self.kv[layer] = (k, v)
        fn = varlen.KERNELS[self.kernel]
        if self.ctx_index is None:
            out, lse = fn(q, k, v, self.cu_q, self.cu_q, self.max_q, self.max_q, True, scale)
        else:
            bk, bv = self.base_kv[layer]  # type: ignore[index]
            kc = torch.cat([bk, k]).index_select(0, self.ctx_index)
            vc = torch.cat([bv, v]).index_select(0, self.ctx_index)
            out, lse = fn(q, kc, vc, self.cu_q, self.cu_k, self.max_q, self.max_k, True, scale)
        if self.prefix is not None:
            pk, pv = self.prefix.layers[layer]
            p_out, p_lse = fn(q, pk, pv, self.cu_all, self.prefix.cu, q.shape[0], self.prefix.length, False, scale)
            out = varlen.merge_lse(out, lse, p_out, p_lse)
        return out.unsqueeze(0)  # [1, T, H, D], what transformers' attention functions return


def _attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    call: PackedCall | None = kwargs.get("triage_packed")
    if call is None:
        raise RuntimeError(f"attention implementation {IMPL!r} runs only inside a packed call")
    scale = scaling if scaling is not None else varlen.default_scale(query.shape[-1])
    return call.attend(module.layer_idx, query, key, value, scale), None


AttentionInterface.register(IMPL, _attention_forward)


@contextmanager
def packed_attention(model: PreTrainedModel) -> Iterator[None]:
    """Route the model's attention to the packed function for one call, then restore it.

    The implementation name is not registered as a mask function, so transformers
    builds no attention mask for the call (rows are delimited by ``cu`` instead).
    """
    config = model.config
    saved = config._attn_implementation
    config._attn_implementation = IMPL
    try:
        yield
    finally:
        config._attn_implementation = saved


@dataclass
class Layout:
    """Where each row lives in the packed stream (host lists; tensors are built from them)."""

    lengths: list[int]
    starts: list[int]
    total: int  # real tokens
    padded_total: int  # tokens in the call (>= total: a fixed shape for CUDA graphs)
    segments: int  # cu entries - 1 (>= rows: zero-length slots for a fixed shape)
    max_len: int  # >= longest row (the kernels' max_q)

    @classmethod
    def build(
        cls,
        lengths: Sequence[int],
        padded_total: int | None = None,
        segments: int | None = None,
        max_len: int | None = None,
    ) -> Layout:
        lengths = list(lengths)
        starts, t = [], 0
        for n in lengths:
            starts.append(t)
            t += n
        return cls(
            lengths,
            starts,
            t,
            max(t, padded_total or 0),
            max(len(lengths), segments or 0),
            max(max(lengths), max_len or 0),
        )

    def cu(self) -> list[int]:
        ends = [s + n for s, n in zip(self.starts, self.lengths)]
        return [0] + ends + [self.total] * (self.segments - len(self.lengths))


def prefix_layers(layers: Sequence[tuple[torch.Tensor, torch.Tensor]], length: int) -> PrefixLayers:
    """[1, Hkv, P, D] cache tensors -> contiguous [P, Hkv, D] (done once per prefix)."""
    conv = tuple((k[0].transpose(0, 1).contiguous(), v[0].transpose(0, 1).contiguous()) for k, v in layers)
    dev = conv[0][0].device if conv else torch.device("cpu")
    return PrefixLayers(layers=conv, length=length, cu=upload(torch.tensor([0, length], dtype=torch.int32), dev))


def call_decoder(model: PreTrainedModel, ids: torch.Tensor, pos: torch.Tensor, call: PackedCall) -> torch.Tensor:
    """One packed forward through the model's own decoder; returns hidden states [T, H].

    Everything the attention function needs is on the device before the call: inside it
    there is no host sync and no host-to-device copy, so the call can be captured as a
    CUDA graph (tests/integration/test_packed.py checks this on the meta device).
    """
    from worker.engine.forward import decoder

    if call.cu_all is None or call.cu_all.device != ids.device:
        call.cu_all = upload(torch.tensor([0, ids.shape[0]], dtype=torch.int32), ids.device)
    with packed_attention(model):
        out = decoder(model)(input_ids=ids[None], position_ids=pos[None], use_cache=False, triage_packed=call)
    return out.last_hidden_state[0]


@dataclass
class PackedState:
    """What a packed main call leaves for the label-continuation call."""

    layout: Layout
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer [padded_total, Hkv, D]
    prefix: PrefixLayers | None
    kernel: str
    next_pos: torch.Tensor  # [rows] host copy: position id of each row's next token


def _ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """cat(arange(s, s + n) for s, n in zip(starts, lengths)), vectorised."""
    total = int(lengths.sum())
    offsets = torch.cumsum(lengths, 0) - lengths
    return torch.repeat_interleave(starts - offsets, lengths, output_size=total) + torch.arange(total)


def stream_tensors(rows: Sequence[Sequence[int]], layout: Layout, past: int, pad_id: int) -> tuple[torch.Tensor, ...]:
    """Host tensors of a packed call: ids, position ids, cu (int32), row of each real token, offset within its row."""
    lens = torch.tensor(layout.lengths, dtype=torch.long)
    starts = torch.tensor(layout.starts, dtype=torch.long)
    ids = torch.full((layout.padded_total,), pad_id, dtype=torch.long)
    ids[: layout.total] = flat_ids(rows, layout.total)
    row = torch.repeat_interleave(torch.arange(len(rows)), lens, output_size=layout.total)
    offset = torch.arange(layout.total) - starts[row]
    pos = torch.zeros(layout.padded_total, dtype=torch.long)
    pos[: layout.total] = offset + past
    cu = torch.tensor(layout.cu(), dtype=torch.int32)
    return ids, pos, cu, row, offset


@torch.inference_mode()
def run_packed(
    model: PreTrainedModel,
    rows: Sequence[Sequence[int]],
    pad_id: int,
    prefix,  # forward.PrefixKV | None
    keep_cache: bool,
    mean_pool: bool,
    pool_from: int = 0,
    kernel: str = "torch",
    runner=None,  # graphs.GraphRunner | None
    on_device=None,  # called once the host-side tensors are built, before any device work (pass timing)
):
    """Forward ``rows`` as one packed stream (after the shared prefix when given); returns ``forward.ForwardOut``.

    The arguments mean what ``forward.run_forward``'s do; ``keep_cache`` keeps the rows' K/V
    (``ForwardOut.packed``) for label continuations."""
    from worker.engine.forward import ForwardOut

    dev = model.device
    past = prefix.length if prefix is not None else 0
    players = prefix_layers_of(prefix)
    layout = Layout.build([len(r) for r in rows])
    if runner is not None:
        layout = runner.layout_for(layout)
    ids, pos, cu, row, offset = stream_tensors(rows, layout, past, pad_id)
    if on_device is not None:  # with the tokens a graph's rounded shape adds: replay or eager, all are computed
        on_device(layout.padded_total - layout.total)
    hidden, kv = None, []
    if runner is not None:
        got = runner.run(layout, ids, pos, cu, players, keep_cache, kernel)
        if got is not None:
            hidden, kv = got
    if hidden is None:
        call = PackedCall(kernel=kernel, cu_q=upload(cu, dev), max_q=layout.max_len, prefix=players, keep_kv=keep_cache)
        hidden = call_decoder(model, upload(ids, dev), upload(pos, dev), call)
        kv = call.kv
    lens = torch.tensor(layout.lengths, dtype=torch.long)
    last = torch.tensor(layout.starts, dtype=torch.long) + lens - 1
    h_last = hidden.index_select(0, upload(last, dev))
    h_mean = None
    if mean_pool:
        keep = offset >= pool_from
        tok, seg = torch.nonzero(keep).squeeze(1), row[keep]
        sums = torch.zeros(len(rows), hidden.shape[-1], dtype=torch.float32, device=dev)
        sums.index_add_(0, upload(seg, dev), hidden.index_select(0, upload(tok, dev)).float())
        counts = upload(torch.bincount(seg, minlength=len(rows)).clamp(min=1).float(), dev)
        h_mean = sums / counts[:, None]
    return ForwardOut(
        h_last=h_last,
        h_mean=h_mean,
        cache=None,
        attention_mask=None,
        next_pos=upload(lens + past, dev),
        packed=PackedState(layout, kv, players, kernel, lens + past) if keep_cache else None,
    )


def prefix_layers_of(prefix) -> PrefixLayers | None:
    """The packed-layout view of a ``forward.PrefixKV`` (converted once, kept on it)."""
    if prefix is None:
        return None
    if prefix.packed is None:
        prefix.packed = prefix_layers(prefix.layers, prefix.length)
    return prefix.packed


@torch.inference_mode()
def run_continuations(model: PreTrainedModel, state: PackedState, inputs: Sequence[Sequence[int]]) -> torch.Tensor:
    """Hidden states of every continuation input after every row of a packed call: [rows, len(inputs), width, H].

    Row s of the call sees the prefix, its ticket's kept K/V and its own earlier
    continuation tokens, exactly as if the continuation followed the ticket in one sequence.
    """
    dev = model.device
    layout = state.layout
    n, m = len(layout.lengths), len(inputs)
    w = torch.tensor([len(x) for x in inputs], dtype=torch.long)
    width, per_row = int(w.max()), int(w.sum())
    q_total = n * per_row
    seg_len = w.repeat(n)  # segments ticket-major: (row 0, input 0), (row 0, input 1), ...
    seg_row = torch.arange(n).repeat_interleave(m)
    seg_qstart = torch.cumsum(seg_len, 0) - seg_len
    ids = flat_ids(inputs).repeat(n)
    q_seg = torch.repeat_interleave(torch.arange(n * m), seg_len, output_size=q_total)
    q_off = torch.arange(q_total) - seg_qstart[q_seg]
    pos = state.next_pos[seg_row][q_seg] + q_off
    cu_q = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(seg_len, 0)]).to(torch.int32)
    # context of segment (row, input): the row's own tokens (kept K/V), then the segment's tokens (this call's K/V)
    row_len = torch.tensor(layout.lengths, dtype=torch.long)[seg_row]
    row_start = torch.tensor(layout.starts, dtype=torch.long)[seg_row]
    parts_start = torch.stack([row_start, layout.padded_total + seg_qstart], 1).reshape(-1)
    parts_len = torch.stack([row_len, seg_len], 1).reshape(-1)
    ctx_index = _ranges(parts_start, parts_len)
    ctx_len = row_len + seg_len
    cu_k = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(ctx_len, 0)]).to(torch.int32)
    call = PackedCall(
        kernel=state.kernel,
        cu_q=upload(cu_q, dev),
        max_q=width,
        prefix=state.prefix,
        ctx_index=upload(ctx_index, dev),
        cu_k=upload(cu_k, dev),
        max_k=int(ctx_len.max()),
        base_kv=state.kv,
    )
    hidden = call_decoder(model, upload(ids, dev), upload(pos, dev), call)  # [q_total, H]
    out = hidden.new_zeros(n, m, width, hidden.shape[-1])
    seg_col = torch.arange(m).repeat(n)[q_seg]
    out[upload(seg_row[q_seg], dev), upload(seg_col, dev), upload(q_off, dev)] = hidden
    return out
