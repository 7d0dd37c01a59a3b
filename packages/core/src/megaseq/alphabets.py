"""Alphabets: the letters a corpus is written in, and how core turns them into token bytes.

A data source declares its alphabet on its record (``megaseq.records.DataSourceSpec.alphabet``; DNA unless it
says otherwise), baselines and eval analyses declare the alphabets they handle (``alphabets`` on their
records), and a recipe's model predicts one token per symbol of its data's alphabet (``model.vocab_size``
defaults to :attr:`Alphabet.size`).

Token byte layout (``megaseq.data.tokenizer``): the low bits are the token id, the letters first
(``0 .. len(letters) - 1``), then the unknown symbol (``unknown_id``); the bit above them
(``softmask_flag``) records that the letter was lower case in the file (a soft-masked region, weighted by
``data.softmask_weight``). DNA's layout is A0 C1 G2 T3 N4 with flag 8; protein's is the twenty amino acids in
alphabetical order of their one-letter codes, X20, flag 32. Ambiguity codes become the unknown symbol: the model
predicts letters only, and a target that is the unknown symbol weighs 0 in the loss. The unknown symbol also
joins a corpus's records into one token stream, so context that crosses it may belong to another record.

This module is light (no numpy, no torch): records import it, and listing plugins imports records.
"""

from __future__ import annotations

import string
from dataclasses import dataclass

MAX_SYMBOLS = 128  # a token and its soft-mask flag fit in one byte


@dataclass(frozen=True)
class Alphabet:
    """``name``: what records and error messages call it; ``letters``: the symbols the model predicts, upper
    case ASCII letters, ids in this order; ``unknown``: the symbol of an unknown letter (N, X), id
    ``len(letters)``; ``ambiguous``: codes read as ``unknown`` (IUPAC's); ``unit``: what one token is called in
    reports ("base", "residue"); ``letter``: what one letter is called in errors ("nucleotide")."""

    name: str
    letters: str
    unknown: str
    ambiguous: str = ""
    unit: str = "token"
    letter: str = "letter"

    def __post_init__(self) -> None:
        symbols = self.letters + self.unknown + self.ambiguous
        if not self.name or not self.letters or len(self.unknown) != 1:
            raise ValueError(f"alphabet {self.name!r}: needs a name, letters and one unknown symbol")
        if any(c not in string.ascii_uppercase for c in symbols) or len(set(symbols)) != len(symbols):
            raise ValueError(
                f"alphabet {self.name!r}: letters, unknown and ambiguous must be distinct upper case ASCII letters "
                f"(lower case marks soft-masked letters), got {symbols!r}"
            )
        if self.size > MAX_SYMBOLS:
            raise ValueError(f"alphabet {self.name!r}: {self.size} symbols; at most {MAX_SYMBOLS} fit a token byte")

    @property
    def size(self) -> int:
        """Token ids the model predicts over: the letters and the unknown symbol."""
        return len(self.letters) + 1

    @property
    def symbols(self) -> str:
        """Every symbol in id order: the letters, then the unknown one."""
        return self.letters + self.unknown

    @property
    def unknown_id(self) -> int:
        return len(self.letters)

    @property
    def softmask_flag(self) -> int:
        """The bit of a token byte that marks a lower case (soft-masked) letter: the power of two above every id."""
        return 1 << self.unknown_id.bit_length()

    @property
    def id_mask(self) -> int:
        """The bits of a token byte that hold the id."""
        return self.softmask_flag - 1


DNA = Alphabet("dna", "ACGT", "N", ambiguous="RYKMSWBDHV", unit="base", letter="nucleotide")
# U (selenocysteine) and O (pyrrolysine) are read as X beside the ambiguity codes B, Z and J: too rare to learn.
PROTEIN = Alphabet("protein", "ACDEFGHIKLMNPQRSTVWY", "X", ambiguous="BZJUO", unit="residue", letter="amino acid")

ALPHABETS: dict[str, Alphabet] = {alphabet.name: alphabet for alphabet in (DNA, PROTEIN)}


def alphabet_named(name: str | Alphabet, where: str = "alphabet") -> Alphabet:
    """Core's alphabet of that name (an :class:`Alphabet` is returned as it is); an unknown name is one line."""
    if isinstance(name, Alphabet):
        return name
    if name not in ALPHABETS:
        raise ValueError(f"{where}: unknown alphabet {name!r}; core's alphabets: {', '.join(ALPHABETS)}")
    return ALPHABETS[name]


__all__ = ["ALPHABETS", "DNA", "MAX_SYMBOLS", "PROTEIN", "Alphabet", "alphabet_named"]
