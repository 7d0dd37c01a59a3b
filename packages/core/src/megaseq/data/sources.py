"""Named corpora (data sources provided by plugins) and the tokenised on-disk cache.

A data source is a record of kind ``data_source`` (``megaseq.records.DataSourceSpec``, hook
``megaseq_data_source``): a name whose target fetches the corpus as one local FASTA file, configured by the
recipe's ``[data_source.NAME]`` section and written in the alphabet its record declares
(``megaseq.alphabets``). Core provides two small DNA excerpts shipped inside megaseq, for tests and demos;
other corpora come from plugins (whole chromosomes, say), registered the same way.
Wherever a dataset is named (``data.train``, ``data.heldout``, ``megaseq data fetch``), a FASTA path works too
(read as DNA). A :class:`Corpus` is a name with its config and the part read, or a path: every function here
takes one where it takes a name.

`tokenized` streams a FASTA through the tokenizer into a flat uint8 file (records joined by one unknown token,
N for DNA, so no k-mer context and no all-letter window silently joins two records) and memory-maps it. The
cache entry is keyed by the FASTA's resolved path, size, mtime and alphabet, and a JSON beside it records where
it came from, the record offsets and the letter counts; a named source's declared counts are checked against
what was read. Both files are written to temporaries and renamed, the JSON last, so a crashed run never leaves
a half-written entry that looks complete.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import ValidationError

from megaseq.alphabets import DNA, Alphabet
from megaseq.data.errors import DataError
from megaseq.data.fasta import iter_fasta_pieces
from megaseq.data.tokenizer import InvalidNucleotide, encode
from megaseq.errors import PluginError
from megaseq.records import PARTS, ComponentConfig, FetchRequest

if TYPE_CHECKING:
    from megaseq.plugins import Plugins, Provided
    from megaseq.records import DataSourceSpec

__all__ = [
    "Corpus",
    "DataError",
    "data_sources",
    "default_cache_dir",
    "fetch",
    "resolve_fasta",
    "token_metadata",
    "tokenized",
]

EXCERPT_DIR = Path(__file__).parent / "excerpt"
# Bumped when the token file or its JSON changes meaning, so that older cache entries are made again.
TOKEN_FORMAT = 2


def excerpt_chr20(request: FetchRequest) -> Path:
    """300 kb of GRCh37 chr20 shipped inside megaseq (the ``excerpt-chr20`` data source)."""
    return EXCERPT_DIR / "grch37_chr20_excerpt.fa.gz"


def excerpt_chrx(request: FetchRequest) -> Path:
    """200 kb of GRCh37 chrX shipped inside megaseq (the ``excerpt-chrX`` data source)."""
    return EXCERPT_DIR / "grch37_chrX_excerpt.fa.gz"


@dataclass(frozen=True)
class Corpus:
    """A corpus as a recipe names it. ``spec``: a data source's name or a FASTA path; ``config``: the source's
    ``[data_source.NAME]`` config (a validated ``ComponentConfig`` or a plain dict; ``None``: its schema's
    defaults); ``part``: ``"train"`` or ``"heldout"``, what the recipe reads it as (a source that declares
    ``parts`` returns that part of its corpus); ``plugins``: where the name is looked up (``None``: the installed
    plugins). ``str(corpus)`` is ``spec``. ``megaseq.config.Recipe.corpus(which)`` makes the recipe's."""

    spec: str
    config: ComponentConfig | dict[str, Any] | None = None
    part: str = "train"
    plugins: Plugins | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "spec", str(self.spec))
        if self.part not in PARTS:
            raise ValueError(f"Corpus.part must be one of {', '.join(PARTS)}, got {self.part!r}")

    def __str__(self) -> str:
        return self.spec

    def record(self) -> DataSourceSpec | None:
        """The data source's record, or ``None`` for a FASTA path."""
        found = data_sources(self.plugins).get(self.spec)
        return None if found is None else found.spec

    @property
    def alphabet(self) -> Alphabet:
        """The alphabet its data source declares; DNA for a FASTA path."""
        record = self.record()
        return DNA if record is None else record.alphabet


def as_corpus(spec: str | Path | Corpus, plugins: Plugins | None = None) -> Corpus:
    """``spec`` as a :class:`Corpus` (a name or path with the source's default config, read as training data);
    ``plugins``, where given, replaces a Corpus's own."""
    if isinstance(spec, Corpus):
        if plugins is None or plugins is spec.plugins:
            return spec
        return Corpus(spec.spec, spec.config, spec.part, plugins)
    return Corpus(str(spec), plugins=plugins)


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


def source_config(record: DataSourceSpec, config: ComponentConfig | dict[str, Any] | None) -> ComponentConfig:
    """``config`` validated by the record's schema (``None``: the schema's defaults); a mistake is one line."""
    if isinstance(config, record.config):
        return config
    if isinstance(config, ComponentConfig):
        raise DataError(f"data source {record.name!r}: its config must be a {record.config.__name__}, got "
                        f"{type(config).__name__}")
    try:
        return record.config(**(config or {}))
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(part) for part in err["loc"])
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        allowed = ", ".join(record.config.model_fields) or "none"
        raise DataError(f"data_source.{record.name}.{key}: {msg}; allowed keys: {allowed} "
                        f"(set them in the recipe's [data_source.{record.name}] section)") from None


def _call_fetch(provided: Provided, request: FetchRequest) -> Path:
    target = provided.load()
    try:
        parameters = list(inspect.signature(target).parameters)
    except (TypeError, ValueError):  # a callable without a signature: the current one is assumed
        parameters = []
    if parameters == ["cache_dir"]:
        # The signature before FetchRequest: still served for one release, with a warning saying how to move.
        warnings.warn(
            f"data source {request.name!r} from {provided.plugin.label.strip()}: fetch(cache_dir) is deprecated; take "
            "fetch(request: megaseq.records.FetchRequest) and use request.cache_dir",
            DeprecationWarning, stacklevel=3,
        )
        return Path(target(request.cache_dir))
    return Path(target(request))


def fetch(
    name: str | Corpus, cache_dir: Path | None = None, plugins: Plugins | None = None,
    config: ComponentConfig | dict[str, Any] | None = None, part: str | None = None,
) -> Path:
    """Local FASTA path of the data source ``name`` (or a :class:`Corpus`'s), fetched by its plugin if needed:
    with ``config`` (its ``[data_source.NAME]``; default: the Corpus's, else the schema's defaults), for a source
    that declares ``parts`` the ``part`` (default: the Corpus's, else ``"train"``)."""
    corpus = as_corpus(name, plugins)
    config = corpus.config if config is None else config
    part = corpus.part if part is None else part
    sources = data_sources(corpus.plugins)
    if corpus.spec not in sources:
        raise DataError(f"unknown dataset {corpus.spec!r}; known datasets: {', '.join(sorted(sources)) or 'none'} "
                        "(is the plugin that provides it installed? `megaseq data list` lists the known ones)")
    provided = sources[corpus.spec]
    record = provided.spec
    if part not in PARTS:
        raise DataError(f"data source {record.name!r}: part {part!r} is not one of {', '.join(PARTS)}")
    request = FetchRequest(record.name, source_config(record, config), Path(cache_dir or default_cache_dir()),
                           part if record.parts else None)
    path = _call_fetch(provided, request)
    if not path.is_file():
        raise PluginError(f"data source {record.name!r} from {provided.plugin.label} returned {path}, which is not a file")
    return path


def _resolve(spec: str | Path | Corpus, cache_dir: Path | None, plugins: Plugins | None) -> tuple[Path, Provided | None, Alphabet]:
    corpus = as_corpus(spec, plugins)
    sources = data_sources(corpus.plugins)
    if corpus.spec in sources:
        provided = sources[corpus.spec]
        return fetch(corpus, cache_dir), provided, provided.spec.alphabet
    path = Path(corpus.spec).expanduser()
    if not path.is_file():
        raise DataError(
            f"{corpus.spec!r} is neither a known dataset ({', '.join(sorted(sources))}) nor an existing file "
            "(is the plugin that provides it installed? `megaseq data list` lists the known ones)"
        )
    return path, None, DNA


def resolve_fasta(spec: str | Path | Corpus, cache_dir: Path | None = None, plugins: Plugins | None = None) -> Path:
    """A data source's name or :class:`Corpus` (fetched if needed), or the path of an existing FASTA file."""
    return _resolve(spec, cache_dir, plugins)[0]


def _token_cache_paths(source: Path, alphabet: Alphabet, cache_dir: Path | None) -> tuple[Path, Path]:
    stat = source.stat()
    identity = f"{source}\0{stat.st_size}\0{stat.st_mtime_ns}\0{alphabet}\0{TOKEN_FORMAT}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    directory = (cache_dir or default_cache_dir()) / "tokens"
    return directory / f"{source.name}-{key}.u8", directory / f"{source.name}-{key}.json"


def _ensure_tokens(spec: str | Path | Corpus, cache_dir: Path | None, plugins: Plugins | None) -> tuple[Path, dict]:
    source, provided, alphabet = _resolve(spec, cache_dir, plugins)
    source = source.resolve()
    tokens_path, meta_path = _token_cache_paths(source, alphabet, cache_dir)
    if meta_path.is_file() and tokens_path.is_file():
        meta = json.loads(meta_path.read_text())
        if tokens_path.stat().st_size == meta["tokens"]:
            if provided is not None:  # another record may name the same file with other counts
                _check_counts(provided, source, meta, alphabet)
            return tokens_path, meta
    tokens_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    meta = _write_tokens(source, tokens_path, provided, alphabet)
    _write_atomically(meta_path, json.dumps(meta, indent=1).encode())
    progress(f"tokenised {source} ({meta['tokens']:,} tokens) in {time.perf_counter() - started:.1f} s")
    return tokens_path, meta


def _write_tokens(source: Path, tokens_path: Path, provided: Provided | None, alphabet: Alphabet) -> dict:
    """Stream the FASTA into a temporary token file, check a named data source's declared counts, rename the
    file into place and return its metadata."""
    histogram = np.zeros(256, dtype=np.int64)
    records: list[dict] = []
    separator = bytes([alphabet.unknown_id])
    fd, tmp_name = tempfile.mkstemp(dir=tokens_path.parent, prefix=".tokens-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            written = 0
            for piece in iter_fasta_pieces(source):
                if piece.record_index == len(records):
                    if records:
                        out.write(separator)
                        written += 1
                    records.append({"name": piece.name, "offset": written, "length": 0})
                record = records[-1]
                try:
                    tokens = encode(piece.sequence, alphabet)
                except InvalidNucleotide as err:
                    raise DataError(
                        f"{source}: record {record['name']!r} position {record['length'] + err.offset}: {err}"
                    ) from None
                out.write(tokens.tobytes())
                histogram += np.bincount(tokens, minlength=256)
                record["length"] += len(tokens)
                written += len(tokens)
        if written == 0:
            raise DataError(f"{source}: FASTA file contains no {alphabet.unit}s")
        stat = source.stat()
        flag = alphabet.softmask_flag
        counts = {symbol: int(histogram[i] + histogram[i | flag]) for i, symbol in enumerate(alphabet.symbols)}
        counts["softmasked"] = int(histogram[flag:].sum())
        meta = {
            "source": str(source),
            "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns,
            "alphabet": alphabet.name,
            "tokens": written,
            "records": records,
            "separators": len(records) - 1,
            "counts": counts,
        }
        if provided is not None:
            _check_counts(provided, source, meta, alphabet)
        os.replace(tmp_name, tokens_path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return meta


def _check_counts(provided: Provided, source: Path, meta: dict, alphabet: Alphabet) -> None:
    """The record's declared ``bases`` and ``n_bases`` against what was read: a mismatch names the declaration."""
    spec = provided.spec
    records = meta["records"]
    read = {"bases": sum(record["length"] for record in records), "n_bases": meta["counts"][alphabet.unknown]}
    what = {"bases": f"{alphabet.unit}s", "n_bases": f"{alphabet.unknown} {alphabet.unit}s"}
    for field_name, found in read.items():
        declared = getattr(spec, field_name)
        if declared is not None and declared != found:
            raise DataError(
                f"data source {spec.name!r} from {provided.plugin.label.strip()} declares {field_name} = {declared:,} on its "
                f"record, but its file {source} holds {found:,} {what[field_name]} in {len(records):,} record(s) "
                f"(the N core puts between records not counted): correct DataSourceSpec.{field_name}, or the file "
                "is damaged or another version (delete it and fetch again)"
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


def tokenized(spec: str | Path | Corpus, cache_dir: Path | None = None, plugins: Plugins | None = None) -> np.ndarray:
    """Read-only memmap (uint8 token bytes in the corpus's alphabet, see tokenizer) of a data source, a
    :class:`Corpus` or a FASTA file, records joined by one unknown token (N)."""
    tokens_path, meta = _ensure_tokens(spec, cache_dir, plugins)
    return np.memmap(tokens_path, dtype=np.uint8, mode="r", shape=(meta["tokens"],))


def token_metadata(spec: str | Path | Corpus, cache_dir: Path | None = None, plugins: Plugins | None = None) -> dict:
    """The JSON beside `tokenized(spec)`: ``source`` (the FASTA read), ``size``, ``mtime_ns``, ``alphabet`` (its
    name), ``tokens`` (the token file's length), ``records`` (name, offset, length of each), ``separators`` (the
    unknown tokens joining the records: ``tokens`` is the records' lengths plus these) and ``counts`` (per symbol
    of the alphabet and ``softmasked``, over the records' letters, the separators not counted: what a record's
    ``bases`` and ``n_bases`` declare)."""
    return _ensure_tokens(spec, cache_dir, plugins)[1]
