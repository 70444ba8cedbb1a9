"""Byte-level BPE tokenizer for the policy presets, trained locally with ``tokenizers``.

Real checkpoints bring their own ``tokenizer.json``; the ``tiny`` and ``small`` presets use one
trained here on the coding task family's text (specs and solutions), so every byte sequence is
encodable (byte-level alphabet) and common Python fragments (``return``, ``    ``, ``for x in``)
are single tokens. Training is deterministic for the same texts and vocabulary size.

Special tokens, in id order: ``<|endoftext|>`` (0, end of a completion, also used as BOS),
``<|pad|>`` (1) and ``<|summary|>`` (2, opens an agent's self-summary segment).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

EOS = "<|endoftext|>"
PAD = "<|pad|>"
SUMMARY = "<|summary|>"
SPECIAL_TOKENS = (EOS, PAD, SUMMARY)
DEFAULT_VOCAB_SIZE = 512


def train_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``texts`` and wrap it as a transformers fast tokenizer."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size {vocab_size} is below the byte alphabet (259); use 512 or more")
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    return wrap(tok)


def wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """Wrap a ``tokenizers.Tokenizer`` with Undertow's special tokens."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        bos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[SUMMARY],
        clean_up_tokenization_spaces=False,
    )


def default_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """The presets' tokenizer: trained on the coding task family's corpus (deterministic)."""
    from policy.tasks import tokenizer_corpus

    return train_tokenizer(tokenizer_corpus(), vocab_size)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """Load a ``tokenizer.json`` (file or the directory holding it)."""
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.exists():
        raise FileNotFoundError(f"no tokenizer.json at {p}; save one with policy.model.save_checkpoint")
    return wrap(Tokenizer.from_file(str(p)))
