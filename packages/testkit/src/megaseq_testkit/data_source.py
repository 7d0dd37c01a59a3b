"""Conformance suite for data sources (see ``megaseq.records.DataSourceSpec``).

Subclass :class:`DataSourceConformance` in a pytest module and set ``name`` (and ``config``, its
``[data_source.NAME]`` section); the tests fetch the source through the installed plugins into ``cache_dir``
(default: megaseq's cache, ``$MEGASEQ_CACHE`` or ~/.cache/megaseq, so a large corpus is fetched once) and
tokenise it. ``factory`` names a record (``"module:attr"`` or ``"/path/file.py:attr"`` of a ``DataSourceSpec``)
to test instead of an installed one; or override :meth:`DataSourceConformance.plugins`. Every check here has a
deliberately wrong data source in the kit's own tests (``packages/testkit/tests/test_data_source_conformance.py``)
that it catches.

The checks:

- ``test_record``: a ``DataSourceSpec`` with a summary, counts that are counts, an alphabet, and a config schema
  that takes ``config``;
- ``test_fetch_gives_one_fasta_file``: each part fetched is a FASTA file with letters;
- ``test_fetch_twice_gives_the_same_file``: a second fetch returns the same file, not rewritten;
- ``test_tokens_match_the_record``: the tokens are the records joined by one unknown token, and the record's
  declared ``bases`` and ``n_bases`` are what was read;
- ``test_no_record_lost``: the records fetched (both parts together) are ``records``, what the test knows its
  input holds, read independently of the source; without ``records``, the record must declare ``bases``
  (a count taken from the source's own output checks nothing);
- ``test_parts_share_no_record``: for a source that declares ``parts``, no sequence of the held-out part is in
  the training part.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
from collections import Counter
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

import pytest

from megaseq.alphabets import Alphabet
from megaseq.data.fasta import iter_fasta_pieces, read_fasta
from megaseq.data.sources import Corpus, default_cache_dir, fetch, token_metadata
from megaseq.hookspecs import hookimpl
from megaseq.records import PARTS, ComponentConfig, DataSourceSpec


def _when(ns: int) -> str:
    """A modification time to the nanosecond, readable."""
    return f"{datetime.fromtimestamp(ns // 10**9).isoformat()}.{ns % 10**9:09d}"


class DataSourceConformance:
    """Base class of a data source's conformance tests."""

    name: ClassVar[str]
    config: ClassVar[dict[str, Any]] = {}
    factory: ClassVar[str | None] = None
    cache_dir: ClassVar[str | None] = None
    records: ClassVar[Sequence[str] | None] = None

    def plugins(self) -> Any:
        """Where the source is looked up: the installed plugins, or with ``factory`` a fresh manager holding that
        record alone (besides core's built-ins)."""
        if self.factory is None:
            from megaseq_testkit import installed_plugins

            return installed_plugins()
        return _factory_plugins(self.factory)

    def where(self) -> Path:
        return Path(self.cache_dir) if self.cache_dir else default_cache_dir()

    def spec(self) -> DataSourceSpec:
        return self.plugins().get("data_source", self.name).spec

    def parts(self) -> tuple[str, ...]:
        """The parts to fetch: both for a source that declares them, else the one corpus (read as training data)."""
        return PARTS if self.spec().parts else ("train",)

    def corpus(self, part: str = "train") -> Corpus:
        return Corpus(self.name, self.config, part, self.plugins())

    def fetch(self, part: str = "train") -> Path:
        return fetch(self.corpus(part), self.where())

    # -- the contract ---------------------------------------------------------------------------------
    def test_record(self) -> None:
        spec = self.spec()
        assert isinstance(spec, DataSourceSpec), f"{self.name}: registered as {type(spec).__name__}, not a DataSourceSpec"
        assert spec.summary, f"{self.name}: summary is its line in `megaseq data list`; say what the corpus is"
        for field in ("bases", "n_bases"):
            value = getattr(spec, field)
            assert value is None or (isinstance(value, int) and value >= 0), f"{self.name}: {field} must be None or a count"
        assert spec.bases is None or spec.n_bases is None or spec.n_bases <= spec.bases, f"{self.name}: more N than bases"
        assert isinstance(spec.alphabet, Alphabet), f"{self.name}: alphabet must be a megaseq.alphabets.Alphabet"
        assert issubclass(spec.config, ComponentConfig), f"{self.name}: config must be a ComponentConfig subclass"
        spec.config(**self.config)  # the suite's config is one a recipe section could give

    def test_fetch_gives_one_fasta_file(self) -> None:
        for part in self.parts():
            path = self.fetch(part)
            assert path.is_file(), f"{self.name}: fetch ({part}) returned {path}, not a file"
            # each record's header yields an empty piece first: look a few pieces in for letters
            assert any(piece.sequence for piece in itertools.islice(iter_fasta_pieces(path), 4)), (
                f"{self.name}: {path} ({part}) holds no FASTA record with letters"
            )

    def test_fetch_twice_gives_the_same_file(self) -> None:
        for part in self.parts():
            first = self.fetch(part)
            before = first.stat().st_mtime_ns
            again = self.fetch(part)
            assert again == first, (
                f"{self.name}: a second fetch ({part}) returned {again}, the first {first}: fetch must return the file it "
                "has"
            )
            after = again.stat().st_mtime_ns
            assert after == before, (
                f"{self.name}: a second fetch ({part}) rewrote {first} (modified at {_when(before)}, then at "
                f"{_when(after)}): fetch must reuse the file it has, not write it again"
            )

    def test_tokens_match_the_record(self) -> None:
        """Tokenising checks the declared counts (a mismatch raises); the tokens are the records joined by one
        unknown token each."""
        spec = self.spec()
        for part in self.parts():
            meta = token_metadata(self.corpus(part), self.where())
            letters = sum(record["length"] for record in meta["records"])
            assert meta["tokens"] == letters + len(meta["records"]) - 1, (
                f"{self.name}: {meta['tokens']:,} tokens for {letters:,} letters in {len(meta['records'])} records"
            )
            assert meta["alphabet"] == spec.alphabet.name
            if spec.bases is not None:
                assert letters == spec.bases, f"{self.name}: declares bases = {spec.bases:,}, read {letters:,}"

    def test_no_record_lost(self) -> None:
        """Every record the input holds reaches the FASTA, whole and once: against ``records``, what the test
        knows its input holds (read without the source), not against counts taken from the source's output."""
        spec = self.spec()
        if self.records is None:
            assert spec.bases is not None, (
                f"{self.name}: nothing to check its records against: declare bases and n_bases on the record, or set "
                "the suite's `records` to the sequences the test's input holds"
            )
            return
        fetched = [sequence.decode() for part in self.parts() for _, sequence in read_fasta(self.fetch(part))]
        expected = ["".join(sequence.split()) for sequence in self.records]
        if not spec.parts:
            assert fetched == expected, self._difference(fetched, expected)
        else:  # the split decides the order; every record is in exactly one part
            assert Counter(fetched) == Counter(expected), self._difference(fetched, expected)

    def _difference(self, fetched: list[str], expected: list[str]) -> str:
        missing = list((Counter(expected) - Counter(fetched)).elements())
        extra = list((Counter(fetched) - Counter(expected)).elements())

        def show(sequences: list[str]) -> str:
            return ", ".join(f"{s[:12]}{'...' if len(s) > 12 else ''} ({len(s)})" for s in sequences[:3]) or "none"

        return (
            f"{self.name}: fetched {len(fetched)} records, the input holds {len(expected)}; missing: {show(missing)}; "
            f"not in the input: {show(extra)}" + ("" if missing or extra else "; the same records in another order")
        )

    def test_parts_share_no_record(self) -> None:
        """The held-out part is no part of the training part: not one sequence of it is a training record."""
        spec = self.spec()
        if not spec.parts:
            pytest.skip(f"{self.name} declares no parts (a recipe may not name it as both train and held-out data)")
        paths = {part: self.fetch(part) for part in PARTS}
        assert paths["train"].resolve() != paths["heldout"].resolve(), (
            f"{self.name}: the training and the held-out part are the same file {paths['train']}"
        )

        def digests(path: Path) -> dict[str, str]:
            return {hashlib.sha256(sequence.upper()).hexdigest(): name for name, sequence in read_fasta(path)}

        train, heldout = digests(paths["train"]), digests(paths["heldout"])
        assert heldout, f"{self.name}: the held-out part {paths['heldout']} holds no record"
        shared = sorted(heldout[d] for d in heldout.keys() & train.keys())
        assert not shared, (
            f"{self.name}: {len(shared)} of the {len(heldout)} held-out records are also training records (e.g. "
            f"{', '.join(shared[:3])}): held-out windows would have been trained on"
        )


@functools.cache
def _factory_plugins(factory: str) -> Any:
    """A fresh plugin manager (core's built-ins) with the record ``factory`` names registered."""
    from megaseq_testkit import fresh_plugins, load_factory

    record = load_factory(factory)
    if not isinstance(record, DataSourceSpec):
        raise TypeError(f"factory {factory!r} is a {type(record).__name__}, not a megaseq.records.DataSourceSpec")

    class Factory:
        @hookimpl
        def megaseq_data_source(self) -> list[DataSourceSpec]:
            return [record]

    plugins = fresh_plugins()
    plugins.register(Factory(), name=f"factory {factory}")
    return plugins
