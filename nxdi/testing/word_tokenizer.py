"""A tiny word-level tokenizer built locally (no hub), for tests of text-in, text-out utilities.

Its ids match the tiny checkpoints of `nxdi.testing.checkpoints`: 0 is `<pad>`, 1 `<s>` (BOS),
2 `</s>` (EOS), and every other id i is the word `w{i}`. Text is split on whitespace and decoded
by joining words with spaces, so `words(ids)` and `decode(ids)` agree for ids >= 3.
"""

from __future__ import annotations

from collections.abc import Iterable

import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

SPECIAL = ("<pad>", "<s>", "</s>")
"""Ids 0, 1, 2: padding, BOS and EOS (the tiny checkpoints' bos_token_id=1, eos_token_id=2)."""


def word_tokenizer(vocab_size: int, *, with_pad: bool = True) -> transformers.PreTrainedTokenizerFast:
    """A fast tokenizer over `vocab_size` ids (see the module docstring). Without `with_pad` it has
    no pad token, as many causal LM tokenizers (Llama's) have none.

    Raises:
        ValueError: `vocab_size` leaves no room for a word (< 4).
    """
    if vocab_size < 4:
        raise ValueError(f"word_tokenizer(vocab_size={vocab_size}): needs at least 4 ids (3 special tokens and a word)")
    vocab = {name: i for i, name in enumerate(SPECIAL)} | {f"w{i}": i for i in range(len(SPECIAL), vocab_size)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>" if with_pad else None,
        unk_token="<pad>",
    )


def words(ids: Iterable[int]) -> str:
    """The text of `ids` (>= 3): `w5 w7 w9`."""
    return " ".join(f"w{i}" for i in ids)
