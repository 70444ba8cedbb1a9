"""Byte-level BPE tokenizer for the policy presets, trained locally with ``tokenizers``.

Real checkpoints bring their own ``tokenizer.json``; the ``tiny`` and ``small`` presets use one
trained here on the coding task family's text (specs and solutions), so every byte sequence is
encodable (byte-level alphabet) and common Python fragments (``return``, ``    ``, ``for x in``)
are single tokens. Training is deterministic for the same texts and vocabulary size.

Special tokens, in id order: ``<|endoftext|>`` (0, end of a completion, also used as BOS),
``<|pad|>`` (1) and ``<|summary|>`` (2, opens an agent's self-summary segment). After the learned
merges come the chat tokens: ``<|im_start|>`` and ``<|im_end|>`` (special: they frame a turn) and
``<tool_call>`` / ``</tool_call>`` (plain added tokens, kept in decoded text so a tool-call parser
sees them). The chat template (:data:`policy.chat_template.CHAT_TEMPLATE`) is set on every tokenizer
and saved in its ``tokenizer_config.json``, so vLLM renders a conversation exactly as the CPU
engine does.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from policy.chat_template import CHAT_TEMPLATE, IM_END, IM_START, TOOL_CALL_END, TOOL_CALL_START

EOS = "<|endoftext|>"
PAD = "<|pad|>"
SUMMARY = "<|summary|>"
SPECIAL_TOKENS = (EOS, PAD, SUMMARY)
CHAT_SPECIAL_TOKENS = (IM_START, IM_END)
TOOL_TOKENS = (TOOL_CALL_START, TOOL_CALL_END)
DEFAULT_VOCAB_SIZE = 1024
REVISION = 4
"""Bumped whenever trained tokenizers change (2: chat and tool-call tokens; 3: fitted on training
tasks only; 4: agent transcripts in the corpus, 1024 tokens); caches key on it."""
PROTOCOL_TASKS = 200
"""Training tasks whose scripted agent transcripts join the corpus (:func:`default_tokenizer`)."""


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
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHAT_SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return wrap(tok)


def wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """Wrap a ``tokenizers.Tokenizer`` with Undertow's special tokens (and the chat template when
    the tokenizer has the chat tokens)."""
    chat = all(tok.token_to_id(t) is not None for t in CHAT_SPECIAL_TOKENS + TOOL_TOKENS)
    specials = [SUMMARY, *CHAT_SPECIAL_TOKENS] if chat else [SUMMARY]
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        bos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=specials,
        clean_up_tokenization_spaces=False,
    )
    if chat:
        wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def default_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """The presets' tokenizer (deterministic): trained on the coding task family's training corpus
    and on the agent harness's transcripts of :data:`PROTOCOL_TASKS` training tasks, rendered with
    the chat template (system prompt, tool specs, calls, verdicts, summaries), so an agent turn's
    framing costs a few tokens and the tiny presets' context holds a whole session."""
    return wrap(Tokenizer.from_str(_default_tokenizer_json(vocab_size)))


@functools.lru_cache(maxsize=4)
def _default_tokenizer_json(vocab_size: int) -> str:
    import random

    from policy.agent_sft import transcript_texts
    from policy.sft import MIXES
    from policy.tasks import tokenizer_corpus, train_tasks

    corpus = tokenizer_corpus()
    template_only = train_tokenizer(corpus, 512)  # renders the transcripts (its vocabulary plays no part)
    tasks = random.Random(0).sample(train_tasks(), PROTOCOL_TASKS)
    trained = train_tokenizer(corpus + transcript_texts(template_only, tasks, 0, MIXES), vocab_size)
    return str(trained.backend_tokenizer.to_str())


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """Load a ``tokenizer.json`` (file or the directory holding it)."""
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.exists():
        raise FileNotFoundError(f"no tokenizer.json at {p}; save one with policy.model.save_checkpoint")
    return wrap(Tokenizer.from_file(str(p)))
