"""The data-source suite (megaseq_testkit.data_source) on core's excerpts, and on wrong sources it must catch."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from megaseq.data.errors import DataError
from megaseq.errors import PluginError
from megaseq.hookspecs import hookimpl
from megaseq.records import DataSourceSpec
from megaseq_testkit import fresh_plugins
from megaseq_testkit.data_source import DataSourceConformance


class TestExcerptChr20(DataSourceConformance):
    name = "excerpt-chr20"


class TestExcerptChrX(DataSourceConformance):
    name = "excerpt-chrX"


def nowhere(cache_dir: Path) -> Path:
    return cache_dir / "never-written.fa"


def refetching(cache_dir: Path) -> Path:
    """Writes its file again on every fetch."""
    path = cache_dir / "refetching" / "x.fa.gz"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    path.write_bytes(gzip.compress(b">x\nACGTACGT\n", mtime=0))
    return path


def empty(cache_dir: Path) -> Path:
    path = cache_dir / "empty" / "x.fa"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(">x\n")
    return path


WRONG = {
    "nowhere": DataSourceSpec(name="nowhere", target=f"{__name__}:nowhere", summary="a file it never writes"),
    "refetching": DataSourceSpec(name="refetching", target=f"{__name__}:refetching", summary="a new file every time"),
    "miscounted": DataSourceSpec(name="miscounted", target="megaseq.data.sources:excerpt_chr20", summary="one base too many",
                                 bases=300_001, n_bases=0),
    "unsummarised": DataSourceSpec(name="unsummarised", target="megaseq.data.sources:excerpt_chr20"),
    "empty": DataSourceSpec(name="empty", target=f"{__name__}:empty", summary="a record without bases"),
}


@pytest.mark.parametrize(
    ("wrong", "check", "error"),
    [
        ("nowhere", "test_fetch_gives_one_fasta_file", PluginError),
        ("empty", "test_fetch_gives_one_fasta_file", AssertionError),
        ("refetching", "test_fetch_twice_gives_the_same_file", AssertionError),
        ("miscounted", "test_tokens_match_the_record", DataError),
        ("unsummarised", "test_record", AssertionError),
    ],
)
def test_suite_catches_wrong_source(wrong: str, check: str, error: type, tmp_path: Path) -> None:
    class Plugin:
        @hookimpl
        def megaseq_data_source(self):
            return [WRONG[wrong]]

    plugins = fresh_plugins()
    plugins.register(Plugin(), name="wrong")

    class Suite(DataSourceConformance):
        name = wrong
        cache_dir = str(tmp_path / "cache")

        def plugins(self):
            return plugins

    with pytest.raises(error):
        getattr(Suite(), check)()
