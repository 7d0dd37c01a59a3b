"""Single-nucleotide tokenizer.

Each base becomes one uint8: the low 3 bits are the token id (A0 C1 G2 T3 N4) and bit 3 (`SOFTMASK_FLAG`)
records that the base was lower case in the FASTA (a soft-masked repeat), so the loss can weight repeats
without a second array. IUPAC ambiguity codes collapse to N because the model predicts only A/C/G/T/N.
Encoding is one lookup in a 256-entry table, so a whole chromosome is tokenised at memory speed.
"""

import numpy as np

from megaseq.data.errors import DataError

VOCAB = "ACGTN"
VOCAB_SIZE = 5
N_ID = 4
SOFTMASK_FLAG = 8
TOKEN_ID_MASK = 7

AMBIGUITY_CODES = "RYKMSWBDHV"
_INVALID = 255


def _encode_table() -> np.ndarray:
    table = np.full(256, _INVALID, dtype=np.uint8)
    for token_id, base in enumerate(VOCAB):
        table[ord(base)] = token_id
        table[ord(base.lower())] = token_id | SOFTMASK_FLAG
    for code in AMBIGUITY_CODES:
        table[ord(code)] = N_ID
        table[ord(code.lower())] = N_ID | SOFTMASK_FLAG
    return table


_ENCODE = _encode_table()
# Index = token byte (id | flag): upper case letter for plain bases, lower case for soft-masked ones.
_DECODE = np.frombuffer((VOCAB + "???" + VOCAB.lower() + "???").encode(), dtype=np.uint8)


class InvalidNucleotide(DataError):
    """A character that is not A/C/G/T/N or an IUPAC ambiguity code; `offset` is its index."""

    def __init__(self, char: str, offset: int) -> None:
        super().__init__(
            f"invalid nucleotide character {char!r} at offset {offset}; allowed: A C G T N and IUPAC codes "
            f"{' '.join(AMBIGUITY_CODES)}, either case"
        )
        self.char = char
        self.offset = offset


def encode(seq: bytes) -> np.ndarray:
    """Token bytes (uint8) of a nucleotide string; InvalidNucleotide (a DataError) on a bad character."""
    tokens = _ENCODE[np.frombuffer(seq, dtype=np.uint8)]
    bad = np.flatnonzero(tokens == _INVALID)
    if bad.size:
        offset = int(bad[0])
        raise InvalidNucleotide(chr(seq[offset]), offset)
    return tokens


def token_ids(arr: np.ndarray) -> np.ndarray:
    """Token ids 0..4 with the soft-mask flag stripped."""
    return arr & TOKEN_ID_MASK


def is_softmasked(arr: np.ndarray) -> np.ndarray:
    """True where the base was lower case in the source."""
    return (arr & SOFTMASK_FLAG) != 0


def decode(arr: np.ndarray) -> str:
    """Inverse of `encode` up to IUPAC codes (which come back as N/n)."""
    return _DECODE[np.asarray(arr, dtype=np.uint8)].tobytes().decode("ascii")
