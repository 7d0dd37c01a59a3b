"""Genome data: FASTA reading, single-nucleotide tokens, named datasets with a token cache, and windows."""

from megaseq.data.errors import DataError
from megaseq.data.fasta import read_fasta
from megaseq.data.sources import (
    DATASETS,
    DatasetInfo,
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
    "DATASETS",
    "N_ID",
    "SOFTMASK_FLAG",
    "VOCAB",
    "VOCAB_SIZE",
    "Batch",
    "DataError",
    "DatasetInfo",
    "GenomeWindows",
    "WindowSampler",
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
