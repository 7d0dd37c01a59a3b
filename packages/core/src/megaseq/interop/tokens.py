"""The token ids of the bases A, C, G, T, N in an imported model's vocabulary (``data.token_ids``).

megaseq feeds a genome as one token per base. A model of megaseq's own 5-symbol vocabulary needs nothing; any
other needs its ``tokenizer.json`` (read with Hugging Face ``tokenizers``) to hold a single-character token for
each of A, C, G, T and N.
"""

from __future__ import annotations

from pathlib import Path

from megaseq.data.tokenizer import VOCAB
from megaseq.interop import InteropError


def token_ids_for(directory: Path, vocab_size: int) -> list[int] | None:
    """The ids of A, C, G, T, N (None: megaseq's own 0..4 with a 5-token vocabulary and no tokenizer)."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        if vocab_size == len(VOCAB):
            return None
        raise InteropError(
            f"{directory}: no tokenizer.json, and vocab_size {vocab_size} is not megaseq's 5 (A C G T N): "
            "the token ids of the bases are unknown"
        )
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise InteropError(f"{path}: reading it needs Hugging Face tokenizers (pip install tokenizers)") from None
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust library raises its own exception types
        raise InteropError(f"{path}: not a readable tokenizer ({exc})".replace("\n", " ")) from None
    ids = []
    for base in VOCAB:
        token_id = tokenizer.token_to_id(base)
        if token_id is None:
            raise InteropError(
                f"{path}: no single-character token for {base!r}; megaseq feeds each of A, C, G, T, N as one token"
            )
        if token_id >= vocab_size:
            raise InteropError(f"{path}: the token {base!r} has id {token_id}, beyond vocab_size {vocab_size}")
        ids.append(token_id)
    if len(set(ids)) != len(ids):
        raise InteropError(f"{path}: the bases A, C, G, T, N do not have distinct token ids ({ids})")
    return None if ids == list(range(len(VOCAB))) and vocab_size == len(VOCAB) else ids
