"""Named corpora (data sources provided by plugins) and the tokenised on-disk cache.

A data source is a record of kind ``data_source`` (``megaseq.records.DataSourceSpec``, hook
``megaseq_data_source``): a name whose target fetches the corpus as one local FASTA file. Core provides two
small DNA excerpts shipped inside megaseq, for tests and demos; other corpora come from plugins
(whole chromosomes, say), registered the same way. Wherever a dataset is named
(``data.train``, ``data.heldout``, ``megaseq data fetch``), a FASTA path works too.

`tokenized` streams a FASTA through the tokenizer into a flat uint8 file (records joined by one N token, so
no k-mer context and no all-base window silently joins two records) and memory-maps it. The cache entry is
keyed by the source's resolved path, size and mtime, and a JSON beside it records where it came from, the
record offsets and base counts; a named source's counts are checked against its record. Both files are
written to temporaries and renamed, the JSON last, so a crashed run never leaves a half-written entry that
looks complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from megaseq.data.errors import DataError
from megaseq.data.fasta import iter_fasta_pieces
from megaseq.data.tokenizer import N_ID, SOFTMASK_FLAG, VOCAB, InvalidNucleotide, encode
from megaseq.errors import PluginError

if TYPE_CHECKING:
    from megaseq.plugins import Plugins, Provided
    from megaseq.records import DataSourceSpec

__all__ = [
    "DataError",
    "data_sources",
    "default_cache_dir",
    "fetch",
    "resolve_fasta",
    "token_metadata",
    "tokenized",
]

EXCERPT_DIR = Path(__file__).parent / "excerpt"


def excerpt_chr20(cache_dir: Path) -> Path:
    """300 kb of GRCh37 chr20 shipped inside megaseq (the ``excerpt-chr20`` data source)."""
    return EXCERPT_DIR / "grch37_chr20_excerpt.fa.gz"


def excerpt_chrx(cache_dir: Path) -> Path:
    """200 kb of GRCh37 chrX shipped inside megaseq (the ``excerpt-chrX`` data source)."""
    return EXCERPT_DIR / "grch37_chrX_excerpt.fa.gz"


def progress(message: str) -> None:
    """A progress line on stderr (fetching and tokenising take seconds to minutes)."""
    print(f"megaseq: {message}", file=sys.stderr, flush=True)


def default_cache_dir() -> Path:
    """$MEGASEQ_CACHE, else ~/.cache/megaseq."""
    return Path(os.environ.get("MEGASEQ_CACHE") or Path.home() / ".cache" / "megaseq")


def data_sources(plugins: Plugins | None = None) -> dict[str, Provided]:
    """``{name: Provided}`` of the installed data sources (``plugins``: by default the installed plugins)."""
    if plugins is None:
        from megaseq.plugins import get_plugins

        plugins = get_plugins()
    return plugins.registry["data_source"]


def fetch(name: str, cache_dir: Path | None = None, plugins: Plugins | None = None) -> Path:
    """Local FASTA path of the data source ``name``, fetched by its plugin if needed."""
    sources = data_sources(plugins)
    if name not in sources:
        raise DataError(f"unknown dataset {name!r}; known datasets: {', '.join(sorted(sources)) or 'none'} "
                        "(is the plugin that provides it installed? `megaseq data list` lists the known ones)")
    provided = sources[name]
    path = Path(provided.load()(cache_dir or default_cache_dir()))
    if not path.is_file():
        raise PluginError(f"data source {name!r} from {provided.plugin.label} returned {path}, which is not a file")
    return path


def _resolve(spec: str | Path, cache_dir: Path | None, plugins: Plugins | None) -> tuple[Path, DataSourceSpec | None]:
    sources = data_sources(plugins)
    if str(spec) in sources:
        return fetch(str(spec), cache_dir, plugins), sources[str(spec)].spec
    path = Path(spec).expanduser()
    if not path.is_file():
        raise DataError(
            f"{spec!r} is neither a known dataset ({', '.join(sorted(sources))}) nor an existing file "
            "(is the plugin that provides it installed? `megaseq data list` lists the known ones)"
        )
    return path, None


def resolve_fasta(spec: str | Path, cache_dir: Path | None = None, plugins: Plugins | None = None) -> Path:
    """A data source's name (fetched if needed) or the path of an existing FASTA file."""
    return _resolve(spec, cache_dir, plugins)[0]


def _token_cache_paths(source: Path, cache_dir: Path | None) -> tuple[Path, Path]:
    stat = source.stat()
    key = hashlib.sha256(f"{source}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    directory = (cache_dir or default_cache_dir()) / "tokens"
    return directory / f"{source.name}-{key}.u8", directory / f"{source.name}-{key}.json"


def _ensure_tokens(spec: str | Path, cache_dir: Path | None, plugins: Plugins | None) -> tuple[Path, dict]:
    source, record = _resolve(spec, cache_dir, plugins)
    source = source.resolve()
    tokens_path, meta_path = _token_cache_paths(source, cache_dir)
    if meta_path.is_file() and tokens_path.is_file():
        meta = json.loads(meta_path.read_text())
        if tokens_path.stat().st_size == meta["tokens"]:
            return tokens_path, meta
    tokens_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    meta = _write_tokens(source, tokens_path, record)
    _write_atomically(meta_path, json.dumps(meta, indent=1).encode())
    progress(f"tokenised {source} ({meta['tokens']:,} tokens) in {time.perf_counter() - started:.1f} s")
    return tokens_path, meta


def _write_tokens(source: Path, tokens_path: Path, dataset: DataSourceSpec | None) -> dict:
    """Stream the FASTA into a temporary token file, check a named data source's base counts, rename the file
    into place and return its metadata."""
    histogram = np.zeros(16, dtype=np.int64)
    records: list[dict] = []
    fd, tmp_name = tempfile.mkstemp(dir=tokens_path.parent, prefix=".tokens-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            written = 0
            for piece in iter_fasta_pieces(source):
                if piece.record_index == len(records):
                    if records:
                        out.write(bytes([N_ID]))
                        histogram[N_ID] += 1
                        written += 1
                    records.append({"name": piece.name, "offset": written, "length": 0})
                record = records[-1]
                try:
                    tokens = encode(piece.sequence)
                except InvalidNucleotide as err:
                    raise DataError(
                        f"{source}: record {record['name']!r} position {record['length'] + err.offset}: {err}"
                    ) from None
                out.write(tokens.tobytes())
                histogram += np.bincount(tokens, minlength=16)
                record["length"] += len(tokens)
                written += len(tokens)
        if written == 0:
            raise DataError(f"{source}: FASTA file contains no bases")
        stat = source.stat()
        counts = {base: int(histogram[i] + histogram[i | SOFTMASK_FLAG]) for i, base in enumerate(VOCAB)}
        counts["softmasked"] = int(histogram[SOFTMASK_FLAG:].sum())
        meta = {
            "source": str(source),
            "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns,
            "tokens": written,
            "records": records,
            "counts": counts,
        }
        if dataset is not None:
            _check_counts(dataset, source, meta)
        os.replace(tmp_name, tokens_path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return meta


def _check_counts(info: DataSourceSpec, source: Path, meta: dict) -> None:
    bases = sum(record["length"] for record in meta["records"])
    n_bases = meta["counts"]["N"] - (len(meta["records"]) - 1)
    expected = (bases if info.bases is None else info.bases, n_bases if info.n_bases is None else info.n_bases)
    if (bases, n_bases) != expected:
        raise DataError(
            f"{source} has {bases:,} bases ({n_bases:,} N) but dataset {info.name} has {expected[0]:,} "
            f"({expected[1]:,} N): the file is damaged or a different version; delete it and fetch again"
        )


def _write_atomically(path: Path, data: bytes) -> None:
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def tokenized(spec: str | Path, cache_dir: Path | None = None, plugins: Plugins | None = None) -> np.ndarray:
    """Read-only memmap (uint8 token bytes, see tokenizer) of a data source or FASTA file, records joined by N."""
    tokens_path, meta = _ensure_tokens(spec, cache_dir, plugins)
    return np.memmap(tokens_path, dtype=np.uint8, mode="r", shape=(meta["tokens"],))


def token_metadata(spec: str | Path, cache_dir: Path | None = None, plugins: Plugins | None = None) -> dict:
    """The JSON beside `tokenized(spec)`: source, size, mtime_ns, tokens, records, counts."""
    return _ensure_tokens(spec, cache_dir, plugins)[1]
