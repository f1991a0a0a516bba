"""gguf_load.parsed_once: transformers' own GGUF loader parses a file once per conversion, and nothing
outside the conversion is changed (a tiny GGUF written here; no model)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from worker.engine import gguf_load


@pytest.fixture
def tiny_gguf(tmp_path):
    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_vocab_size(4)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def readers_made(monkeypatch):
    """Every GGUFReader really constructed (the class under the one parsed_once swaps in)."""
    made = []

    class Counting(gguf.GGUFReader):
        def __init__(self, path, *args, **kwargs):
            made.append(str(path))
            super().__init__(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    return made


def test_transformers_reads_the_file_once_while_converting(tiny_gguf, readers_made):
    with gguf_load.parsed_once():
        first = load_gguf_checkpoint(str(tiny_gguf), return_tensors=False)
        second = load_gguf_checkpoint(str(tiny_gguf), return_tensors=False)
    assert readers_made == [str(tiny_gguf)]
    assert first["config"] == second["config"] and first["config"]["num_hidden_layers"] == 1


def test_outside_a_conversion_every_load_reads_the_file(tiny_gguf, readers_made):
    counting = gguf.GGUFReader
    with gguf_load.parsed_once():
        load_gguf_checkpoint(str(tiny_gguf), return_tensors=False)
    assert gguf.GGUFReader is counting
    load_gguf_checkpoint(str(tiny_gguf), return_tensors=False)
    assert len(readers_made) == 2


def test_the_tensor_name_map_is_built_once_per_architecture_and_depth():
    original = gguf.get_tensor_name_map
    with gguf_load.parsed_once():
        from gguf import get_tensor_name_map  # as transformers imports it: inside the function, at call time

        a = get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
        assert get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is a
        assert get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 3) is not a
        assert a.get_name("model.layers.1.self_attn.q_proj") == "blk.1.attn_q"
    assert gguf.get_tensor_name_map is original


def test_a_failed_conversion_puts_the_originals_back(tiny_gguf):
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with pytest.raises(RuntimeError), gguf_load.parsed_once():
        raise RuntimeError("conversion failed")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader, name_map)
