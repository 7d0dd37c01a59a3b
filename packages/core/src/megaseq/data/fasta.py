"""Streaming FASTA reader for plain, gzip and bgzip files.

The file is read in fixed-size decompressed blocks; only the last partial line of a block is carried over,
so a chromosome never exists as compressed bytes plus a list of lines at once. bgzip is a series of gzip
members, which Python's gzip module reads as one stream. Compression is detected from the magic bytes, not
the file name. `iter_fasta_pieces` yields a record as several pieces (what tokenisation streams through);
`read_fasta` joins them into whole records.
"""

import gzip
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, NamedTuple

from megaseq.data.errors import DataError

GZIP_MAGIC = b"\x1f\x8b"
READ_BLOCK_BYTES = 1 << 22
_WHITESPACE = b" \t\r\n\v\f"


class FastaPiece(NamedTuple):
    """A run of sequence bytes (whitespace removed) from record number `record_index` (0-based)."""

    record_index: int
    name: str
    sequence: bytes


def _open(path: Path) -> BinaryIO:
    with open(path, "rb") as fh:
        magic = fh.read(2)
    return gzip.open(path, "rb") if magic == GZIP_MAGIC else open(path, "rb")


def iter_fasta_pieces(path: str | Path) -> Iterator[FastaPiece]:
    """Pieces in file order; each header yields an empty piece first, so empty records still appear."""
    path = Path(path)
    record_index = -1
    name = ""
    try:
        with _open(path) as fh:
            carry = b""
            while True:
                block = fh.read(READ_BLOCK_BYTES)
                text = carry + block
                cut = len(text) if not block else text.rfind(b"\n") + 1
                carry = text[cut:]
                pos = 0
                while pos < cut:
                    if text[pos] == ord(">"):
                        end = text.find(b"\n", pos, cut)
                        end = cut if end < 0 else end
                        header = text[pos + 1 : end].decode("utf-8", "replace").split()
                        record_index += 1
                        name = header[0] if header else ""
                        yield FastaPiece(record_index, name, b"")
                        pos = end + 1
                        continue
                    # Sequence lines run until the next line that starts with '>'.
                    header_at = text.find(b"\n>", pos, cut)
                    stop = cut if header_at < 0 else header_at + 1
                    sequence = text[pos:stop].translate(None, _WHITESPACE)
                    if sequence:
                        if record_index < 0:
                            raise DataError(
                                f"{path}: not a FASTA file (no '>' header line before the sequence)"
                            )
                        yield FastaPiece(record_index, name, sequence)
                    pos = stop
                if not block:
                    break
    except (OSError, EOFError, zlib.error) as err:
        raise DataError(f"cannot read FASTA file {path}: {err}") from None
    if record_index < 0:
        raise DataError(f"{path}: not a FASTA file (no '>' header line)")


def read_fasta(path: str | Path) -> Iterator[tuple[str, bytes]]:
    """(record name, sequence bytes without newlines) for each record; the name is the header's first word."""
    chunks: list[bytes] = []
    current: FastaPiece | None = None
    for piece in iter_fasta_pieces(path):
        if current is not None and piece.record_index != current.record_index:
            yield current.name, b"".join(chunks)
            chunks = []
        current = piece
        chunks.append(piece.sequence)
    if current is not None:
        yield current.name, b"".join(chunks)
