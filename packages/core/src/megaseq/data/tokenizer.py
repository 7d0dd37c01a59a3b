"""Single-letter tokenizer: one uint8 per letter of a corpus's alphabet (``megaseq.alphabets``).

The low bits of each byte are the token id (DNA: A0 C1 G2 T3 N4) and the bit above them (the alphabet's
``softmask_flag``, 8 for DNA) records that the letter was lower case in the FASTA (a soft-masked repeat), so
the loss can weight repeats without a second array. Ambiguity codes (DNA: IUPAC's) collapse to the unknown
symbol (N) because the model predicts only the alphabet's letters and the unknown symbol; any other character
is refused, never guessed. Encoding is one lookup in a 256-entry table, so a whole chromosome is tokenised at
memory speed.

The module constants (``VOCAB``, ``N_ID``, ``SOFTMASK_FLAG``, ``TOKEN_ID_MASK``) are DNA's; every function
takes the alphabet, DNA by default.
"""

from functools import cache

import numpy as np

from megaseq.alphabets import DNA, PROTEIN, Alphabet
from megaseq.data.errors import DataError

VOCAB = DNA.symbols
VOCAB_SIZE = DNA.size
N_ID = DNA.unknown_id
SOFTMASK_FLAG = DNA.softmask_flag
TOKEN_ID_MASK = DNA.id_mask

AMBIGUITY_CODES = DNA.ambiguous
_INVALID = 255


@cache
def _encode_table(alphabet: Alphabet) -> np.ndarray:
    table = np.full(256, _INVALID, dtype=np.uint8)
    for token_id, letter in enumerate(alphabet.symbols):
        table[ord(letter)] = token_id
        table[ord(letter.lower())] = token_id | alphabet.softmask_flag
    for code in alphabet.ambiguous:
        table[ord(code)] = alphabet.unknown_id
        table[ord(code.lower())] = alphabet.unknown_id | alphabet.softmask_flag
    return table


@cache
def _decode_table(alphabet: Alphabet) -> np.ndarray:
    """Index = token byte (id | flag): upper case for plain letters, lower case for soft-masked ones."""
    table = np.full(256, ord("?"), dtype=np.uint8)
    for token_id, letter in enumerate(alphabet.symbols):
        table[token_id] = ord(letter)
        table[token_id | alphabet.softmask_flag] = ord(letter.lower())
    return table


class InvalidNucleotide(DataError):
    """A character that is not a letter of the alphabet, its unknown symbol or an ambiguity code; ``offset``
    is its index."""

    def __init__(self, char: str, offset: int, alphabet: Alphabet = DNA) -> None:
        codes = f" and ambiguity codes {' '.join(alphabet.ambiguous)}" if alphabet.ambiguous else ""
        hint = ""
        if alphabet is DNA and char.upper() in PROTEIN.letters:
            hint = (" (protein? a data source that declares alphabet = megaseq.alphabets.PROTEIN reads it; "
                    "a FASTA path is read as DNA)")
        super().__init__(
            f"invalid {alphabet.letter} character {char!r} at offset {offset}; allowed: "
            f"{' '.join(alphabet.symbols)}{codes}, either case{hint}"
        )
        self.char = char
        self.offset = offset


def encode(seq: bytes, alphabet: Alphabet = DNA) -> np.ndarray:
    """Token bytes (uint8) of a sequence; InvalidNucleotide (a DataError) on a character outside ``alphabet``."""
    tokens = _encode_table(alphabet)[np.frombuffer(seq, dtype=np.uint8)]
    bad = np.flatnonzero(tokens == _INVALID)
    if bad.size:
        offset = int(bad[0])
        raise InvalidNucleotide(chr(seq[offset]), offset, alphabet)
    return tokens


def token_ids(arr: np.ndarray, alphabet: Alphabet = DNA) -> np.ndarray:
    """Token ids (DNA: 0..4) with the soft-mask flag stripped."""
    return arr & alphabet.id_mask


def is_softmasked(arr: np.ndarray, alphabet: Alphabet = DNA) -> np.ndarray:
    """True where the letter was lower case in the source."""
    return (arr & alphabet.softmask_flag) != 0


def decode(arr: np.ndarray, alphabet: Alphabet = DNA) -> str:
    """Inverse of `encode` up to ambiguity codes (which come back as the unknown symbol, N/n for DNA)."""
    return _decode_table(alphabet)[np.asarray(arr, dtype=np.uint8)].tobytes().decode("ascii")
