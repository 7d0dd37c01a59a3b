"""Named genome datasets, fetching them from Debian packages, and the tokenised on-disk cache.

Datasets come from Debian example packages so that no network service beyond the distribution mirror is
needed: `fetch` uses the cache, then an installed copy under /usr/share/doc, then `apt-get download` +
`dpkg-deb -x` (neither needs root). Two small excerpts ship inside megaseq for tests and demos.

`tokenized` streams a FASTA through the tokenizer into a flat uint8 file (records joined by one N token, so
no Markov context and no all-base window silently joins two records) and memory-maps it. The cache entry is
keyed by the source's resolved path, size and mtime, and a JSON beside it records where it came from, the
record offsets and base counts. Both files are written to temporaries and renamed, the JSON last, so a
crashed run never leaves a half-written entry that looks complete.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np

from megaseq.data.errors import DataError
from megaseq.data.fasta import iter_fasta_pieces
from megaseq.data.tokenizer import N_ID, SOFTMASK_FLAG, VOCAB, InvalidNucleotide, encode

__all__ = [
    "DATASETS",
    "DataError",
    "DatasetInfo",
    "default_cache_dir",
    "fetch",
    "resolve_fasta",
    "token_metadata",
    "tokenized",
]

# Installed Debian packages put their files here; tests point it at a temporary directory.
SYSTEM_ROOT = Path("/")
EXCERPT_DIR = Path(__file__).parent / "excerpt"


@dataclass(frozen=True)
class DatasetInfo:
    """A named FASTA file. `package` is the Debian package holding `member` (a path inside it), or None for
    an excerpt shipped inside megaseq, whose `member` is then a file name in megaseq/data/excerpt."""

    name: str
    description: str
    package: str | None
    member: str
    bases: int
    n_bases: int


DATASETS: dict[str, DatasetInfo] = {
    info.name: info
    for info in [
        DatasetInfo(
            "grch37-chr20",
            "human GRCh37 chromosome 20, complete, upper case (training chromosome)",
            "vt-examples",
            "usr/share/doc/vt/examples/ref/20.fa.gz",
            bases=63_025_520,
            n_bases=3_520_000,
        ),
        DatasetInfo(
            "grch37-chrX",
            "human GRCh37 chromosome X, first 70 Mb, upper case (held-out chromosome)",
            "smalt-examples",
            "usr/share/doc/smalt/test/data/hs37chrXtrunc.fa.gz",
            bases=69_999_930,
            n_bases=3_760_000,
        ),
        DatasetInfo(
            "excerpt-chr20",
            "300 kb of GRCh37 chr20 (40,000,001-40,300,000) from vt-examples, shipped with megaseq",
            None,
            "grch37_chr20_excerpt.fa.gz",
            bases=300_000,
            n_bases=0,
        ),
        DatasetInfo(
            "excerpt-chrX",
            "200 kb of GRCh37 chrX (40,000,001-40,200,000) from smalt-examples, shipped with megaseq",
            None,
            "grch37_chrX_excerpt.fa.gz",
            bases=200_000,
            n_bases=0,
        ),
    ]
}


def _progress(message: str) -> None:
    print(f"megaseq: {message}", file=sys.stderr, flush=True)


def _dataset(name: str) -> DatasetInfo:
    if name not in DATASETS:
        raise DataError(f"unknown dataset {name!r}; known datasets: {', '.join(DATASETS)}")
    return DATASETS[name]


def default_cache_dir() -> Path:
    """$MEGASEQ_CACHE, else ~/.cache/megaseq."""
    return Path(os.environ.get("MEGASEQ_CACHE") or Path.home() / ".cache" / "megaseq")


def fetch(name: str, cache_dir: Path | None = None) -> Path:
    """Local path of the named dataset's FASTA, extracting it from its Debian package if needed."""
    info = _dataset(name)
    if info.package is None:
        return EXCERPT_DIR / info.member
    target = (cache_dir or default_cache_dir()) / name / PurePosixPath(info.member).name
    if target.is_file():
        return target
    installed = SYSTEM_ROOT / info.member
    if installed.is_file():
        _progress(f"{name}: using {installed} from the installed Debian package {info.package}")
        return installed
    return _extract_from_debian(info, target)


def _extract_from_debian(info: DatasetInfo, target: Path) -> Path:
    assert info.package is not None
    advice = (
        f"install Debian package {info.package} (apt-get install {info.package}) or download "
        f"/{info.member} from it and pass that file's path"
    )
    missing = [tool for tool in ("apt-get", "dpkg-deb") if shutil.which(tool) is None]
    if missing:
        raise DataError(f"cannot fetch {info.name}: {' and '.join(missing)} not found; {advice}")
    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    # Extract next to the target so the final rename stays on one file system (atomic).
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        _progress(f"{info.name}: apt-get download {info.package}")
        _run(["apt-get", "download", info.package], Path(tmp), info, advice)
        debs = sorted(Path(tmp).glob(f"{info.package}_*.deb"))
        if not debs:
            raise DataError(f"cannot fetch {info.name}: apt-get produced no {info.package} .deb; {advice}")
        _progress(f"{info.name}: extracting {debs[0].name}")
        _run(["dpkg-deb", "-x", str(debs[0]), "root"], Path(tmp), info, advice)
        extracted = Path(tmp) / "root" / info.member
        if not extracted.is_file():
            raise DataError(f"cannot fetch {info.name}: {debs[0].name} has no {info.member}; {advice}")
        index = extracted.with_name(extracted.name + ".fai")
        if index.is_file():
            os.replace(index, target.with_name(target.name + ".fai"))
        os.replace(extracted, target)
    _progress(f"{info.name}: {target} ready in {time.perf_counter() - started:.1f} s")
    return target


def _run(command: list[str], cwd: Path, info: DatasetInfo, advice: str) -> None:
    result = subprocess.run(command, check=False, cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        lines = (result.stderr or result.stdout).strip().splitlines()
        reason = lines[-1] if lines else f"exit status {result.returncode}"
        raise DataError(f"cannot fetch {info.name}: `{' '.join(command)}` failed ({reason}); {advice}")


def resolve_fasta(spec: str | Path, cache_dir: Path | None = None) -> Path:
    """A dataset name (fetched if needed) or the path of an existing FASTA file."""
    if str(spec) in DATASETS:
        return fetch(str(spec), cache_dir)
    path = Path(spec).expanduser()
    if not path.is_file():
        raise DataError(f"{spec!r} is neither a known dataset ({', '.join(DATASETS)}) nor an existing file")
    return path


def _token_cache_paths(source: Path, cache_dir: Path | None) -> tuple[Path, Path]:
    stat = source.stat()
    key = hashlib.sha256(f"{source}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    directory = (cache_dir or default_cache_dir()) / "tokens"
    return directory / f"{source.name}-{key}.u8", directory / f"{source.name}-{key}.json"


def _ensure_tokens(spec: str | Path, cache_dir: Path | None) -> tuple[Path, dict]:
    source = resolve_fasta(spec, cache_dir).resolve()
    tokens_path, meta_path = _token_cache_paths(source, cache_dir)
    if meta_path.is_file() and tokens_path.is_file():
        meta = json.loads(meta_path.read_text())
        if tokens_path.stat().st_size == meta["tokens"]:
            return tokens_path, meta
    tokens_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    meta = _write_tokens(source, tokens_path, DATASETS.get(str(spec)))
    _write_atomically(meta_path, json.dumps(meta, indent=1).encode())
    _progress(f"tokenised {source} ({meta['tokens']:,} tokens) in {time.perf_counter() - started:.1f} s")
    return tokens_path, meta


def _write_tokens(source: Path, tokens_path: Path, dataset: DatasetInfo | None) -> dict:
    """Stream the FASTA into a temporary token file, check a named dataset's base counts, rename the file
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


def _check_counts(info: DatasetInfo, source: Path, meta: dict) -> None:
    bases = sum(record["length"] for record in meta["records"])
    n_bases = meta["counts"]["N"] - (len(meta["records"]) - 1)
    if (bases, n_bases) != (info.bases, info.n_bases):
        raise DataError(
            f"{source} has {bases:,} bases ({n_bases:,} N) but dataset {info.name} has {info.bases:,} "
            f"({info.n_bases:,} N): the file is damaged or a different version; delete it and fetch again"
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


def tokenized(spec: str | Path, cache_dir: Path | None = None) -> np.ndarray:
    """Read-only memmap (uint8 token bytes, see tokenizer) of a dataset or FASTA file, records joined by N."""
    tokens_path, meta = _ensure_tokens(spec, cache_dir)
    return np.memmap(tokens_path, dtype=np.uint8, mode="r", shape=(meta["tokens"],))


def token_metadata(spec: str | Path, cache_dir: Path | None = None) -> dict:
    """The JSON beside `tokenized(spec)`: source, size, mtime_ns, tokens, records, counts."""
    return _ensure_tokens(spec, cache_dir)[1]
