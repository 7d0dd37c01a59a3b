"""Conformance suite for data sources (see ``megaseq.records.DataSourceSpec``).

Subclass :class:`DataSourceConformance` in a pytest module and set ``name``; the tests fetch the source
through the installed plugins into ``cache_dir`` (default: megaseq's cache, ``$MEGASEQ_CACHE`` or
~/.cache/megaseq, so a large corpus is fetched once) and tokenise it. Override :meth:`DataSourceConformance.plugins` for
one that is not installed. Every check here has a deliberately wrong data source in core's own tests
(``packages/testkit/tests/test_data_source_conformance.py``) that it catches.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, ClassVar

from megaseq.data.fasta import iter_fasta_pieces
from megaseq.data.sources import default_cache_dir, fetch, token_metadata
from megaseq.records import DataSourceSpec


class DataSourceConformance:
    """Base class of a data source's conformance tests."""

    name: ClassVar[str]
    cache_dir: ClassVar[str | None] = None

    def plugins(self) -> Any:
        from megaseq_testkit import installed_plugins

        return installed_plugins()

    def where(self) -> Path:
        return Path(self.cache_dir) if self.cache_dir else default_cache_dir()

    def test_record(self) -> None:
        found = self.plugins().get("data_source", self.name)
        spec = found.spec
        assert isinstance(spec, DataSourceSpec), f"{self.name}: registered as {type(spec).__name__}, not a DataSourceSpec"
        assert spec.summary, f"{self.name}: summary is its line in `megaseq data list`; say what the corpus is"
        for field in ("bases", "n_bases"):
            value = getattr(spec, field)
            assert value is None or (isinstance(value, int) and value >= 0), f"{self.name}: {field} must be None or a count"
        assert spec.bases is None or spec.n_bases is None or spec.n_bases <= spec.bases, f"{self.name}: more N than bases"

    def test_fetch_gives_one_fasta_file(self) -> None:
        path = fetch(self.name, self.where(), self.plugins())
        assert path.is_file(), f"{self.name}: fetch returned {path}, not a file"
        # each record's header yields an empty piece first: look a few pieces in for bases
        assert any(piece.sequence for piece in itertools.islice(iter_fasta_pieces(path), 4)), (
            f"{self.name}: {path} holds no FASTA record with bases"
        )

    def test_fetch_twice_gives_the_same_file(self) -> None:
        first = fetch(self.name, self.where(), self.plugins())
        stat = first.stat()
        again = fetch(self.name, self.where(), self.plugins())
        assert again == first and again.stat().st_mtime_ns == stat.st_mtime_ns, (
            f"{self.name}: a second fetch gave {again}, not the unchanged {first} (fetch must reuse what it has)"
        )

    def test_tokens_match_the_record(self) -> None:
        """Tokenising checks the declared counts (a mismatch raises); the tokens are the records joined by N."""
        meta = token_metadata(self.name, self.where(), self.plugins())
        spec = self.plugins().get("data_source", self.name).spec
        bases = sum(record["length"] for record in meta["records"])
        assert meta["tokens"] == bases + len(meta["records"]) - 1
        if spec.bases is not None:
            assert bases == spec.bases
