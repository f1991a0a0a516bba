"""Build a tiny random-weight causal LM + a real (small, trained) BPE tokenizer in a directory.

Lets tests exercise the production loading path (``TRIAGE_MODEL=<dir>``) in
well under a second per load, with no model hub.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SCALE = 4.0  # random init is tiny (std 0.02): scale up so label scores differ visibly

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "I was charged twice for my subscription, please refund me.",
    "The app crashes when I open settings. Error 500 on login page.",
    "I cannot log in, my password reset email never arrives.",
    "Where is my package? Tracking says in transit for ten days.",
    "Do you offer discounts for non-profits? Thanks for the great product!",
    "billing technical account shipping other accounting account_manager refund invoice",
    "You are a customer-support triage assistant. Categories: answer with one category name.",
    "charges refunds invoices payments bugs errors outages login password delivery tracking feedback",
]


def build_tokenizer(chat: bool = True) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None if chat else "<|endoftext|>",
    )
    if chat:
        fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(path: Path, seed: int = 0, layers: int = 2, hidden: int = 64, chat: bool = True) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(chat=chat)
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
    )
    model = scaled_up(Qwen2ForCausalLM(cfg))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def edited_model(src: Path, dst: Path, edit_embeddings) -> Path:
    """``src``'s causal LM saved to ``dst`` with ``edit_embeddings(weight)`` applied in place to its input
    embeddings, untied from the LM head first (only the input changes): an overflow or broken weights, on purpose."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, tie_word_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.clone())
        edit_embeddings(model.get_input_embeddings().weight)
    model.save_pretrained(dst)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return Path(dst)


def build_bert_tokenizer():
    """A WordPiece tokenizer (BERT style: lower case, [CLS] ... [SEP]) trained on the tiny corpus."""
    from tokenizers import normalizers, processors
    from transformers import BertTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    trainer = trainers.WordPieceTrainer(vocab_size=400, special_tokens=special, show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    return BertTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )


def build_tiny_bert(path: Path, seed: int = 0, layers: int = 2, hidden: int = 48) -> Path:
    """A tiny random BERT encoder (``BertModel``, like sentence-transformers checkpoints) + WordPiece tokenizer."""
    from transformers import BertConfig, BertModel

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_bert_tokenizer()
    torch.manual_seed(seed)
    cfg = BertConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        max_position_embeddings=128,
        pad_token_id=tok.pad_token_id,
        architectures=["BertModel"],
    )
    model = BertModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(SCALE)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    (path / "sentence_bert_config.json").write_text('{"max_seq_length": 64, "do_lower_case": false}')
    return path


def scaled_up(model: torch.nn.Module) -> torch.nn.Module:
    """Every weight matrix times ``SCALE``, in place: label scores that differ visibly."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(SCALE)
    return model
