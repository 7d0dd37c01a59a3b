"""Sequence data: FASTA reading, single-letter tokens of an alphabet, named data sources with a token cache, and
windows."""

from megaseq.data.errors import DataError
from megaseq.data.fasta import read_fasta
from megaseq.data.sources import (
    Corpus,
    data_sources,
    default_cache_dir,
    fetch,
    resolve_fasta,
    token_metadata,
    tokenized,
)
from megaseq.data.tokenizer import (
    N_ID,
    SOFTMASK_FLAG,
    VOCAB,
    VOCAB_SIZE,
    decode,
    encode,
    is_softmasked,
    token_ids,
)
from megaseq.data.windows import Batch, GenomeWindows, WindowSampler

__all__ = [
    "N_ID",
    "SOFTMASK_FLAG",
    "VOCAB",
    "VOCAB_SIZE",
    "Batch",
    "Corpus",
    "DataError",
    "GenomeWindows",
    "WindowSampler",
    "data_sources",
    "decode",
    "default_cache_dir",
    "encode",
    "fetch",
    "is_softmasked",
    "read_fasta",
    "resolve_fasta",
    "token_ids",
    "token_metadata",
    "tokenized",
]
