"""The GRCh37 data sources: fetched from the cache, an installed Debian package, or a downloaded one
(a fake apt-get serves a .deb built here); and, where the chromosomes are on this machine, core's data-source
suite on them."""

import gzip
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from megaseq.data import DataError, read_fasta
from megaseq.data.sources import default_cache_dir
from megaseq.records import FetchRequest, NoConfig
from megaseq_genome import sources
from megaseq_testkit.data_source import DataSourceConformance


@pytest.fixture
def no_system_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No 'installed' Debian files, so nothing reads /usr."""
    monkeypatch.setattr(sources, "SYSTEM_ROOT", tmp_path / "system-root")


def test_fetch_uses_installed_package_file(tmp_path: Path, no_system_files: None) -> None:
    member = sources.SYSTEM_ROOT / sources.CHR20.member
    member.parent.mkdir(parents=True)
    member.write_bytes(b">20\nACGT\n")
    request = FetchRequest("grch37-chr20", NoConfig(), tmp_path / "cache")
    assert sources.fetch(request) == member  # the target of both records, told which one by its name


def test_fetch_prefers_cache(tmp_path: Path, no_system_files: None) -> None:
    cached = tmp_path / "cache" / "grch37-chrX" / "hs37chrXtrunc.fa.gz"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b">X\nACGT\n")
    assert sources.fetch_debian(sources.CHRX, tmp_path / "cache") == cached


def test_fetch_without_apt_get_says_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_system_files: None) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    with pytest.raises(DataError) as info:
        sources.fetch_debian(sources.CHR20, tmp_path / "cache")
    message = str(info.value)
    assert "apt-get and dpkg-deb not found" in message
    assert "apt-get install vt-examples" in message and "/usr/share/doc/vt/examples/ref/20.fa.gz" in message


def fake_apt_get(bin_dir: Path, script: str) -> None:
    """Put an `apt-get` shell script first on PATH (the real dpkg-deb stays reachable)."""
    bin_dir.mkdir(exist_ok=True)
    tool = bin_dir / "apt-get"
    tool.write_text("#!/bin/sh\n" + script)
    tool.chmod(0o755)


def test_fetch_reports_apt_get_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_system_files: None) -> None:
    fake_apt_get(tmp_path / "bin", "echo 'E: Unable to locate package vt-examples' >&2\nexit 100\n")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(
        DataError, match=r"failed \(E: Unable to locate package vt-examples\); install Debian"
    ):
        sources.fetch_debian(sources.CHR20, tmp_path / "cache")


@pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="building a test .deb needs dpkg-deb")
def test_fetch_extracts_fasta_and_index_from_deb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_system_files: None) -> None:
    info = sources.CHRX
    tree = tmp_path / "pkg"
    member = tree / info.member
    member.parent.mkdir(parents=True)
    member.write_bytes(gzip.compress(b">X\nACGTN\n"))
    member.with_name(member.name + ".fai").write_text("X\t5\t3\t5\t6\n")
    (member.parent / "other.txt").write_text("not kept")
    (tree / "DEBIAN").mkdir()
    (tree / "DEBIAN" / "control").write_text(
        "Package: smalt-examples\nVersion: 1.0\nArchitecture: all\n"
        "Maintainer: t <t@example.org>\nDescription: t\n"
    )
    deb = tmp_path / "smalt-examples_1.0_all.deb"
    subprocess.run(
        ["dpkg-deb", "--build", "--root-owner-group", str(tree), str(deb)], check=True, capture_output=True
    )
    fake_apt_get(tmp_path / "bin", f'[ "$1 $2" = "download smalt-examples" ] || exit 3\ncp {deb} .\n')
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")

    path = sources.fetch_debian(sources.CHRX, tmp_path / "cache")
    assert path == tmp_path / "cache" / "grch37-chrX" / "hs37chrXtrunc.fa.gz"
    assert list(read_fasta(path)) == [("X", b"ACGTN")]
    assert sorted(p.name for p in path.parent.iterdir()) == ["hs37chrXtrunc.fa.gz", "hs37chrXtrunc.fa.gz.fai"]


def on_this_machine(name: str, member: str) -> bool:
    """Whether the chromosome can be had without a download (the cache or the installed package)."""
    return (default_cache_dir() / name / Path(member).name).is_file() or (Path("/") / member).is_file()


@pytest.mark.skipif(not on_this_machine("grch37-chr20", sources.CHR20.member), reason="grch37-chr20 is not on this machine (megaseq data fetch grch37-chr20)")
class TestChr20Conformance(DataSourceConformance):
    name = "grch37-chr20"


@pytest.mark.skipif(not on_this_machine("grch37-chrX", sources.CHRX.member), reason="grch37-chrX is not on this machine (megaseq data fetch grch37-chrX)")
class TestChrXConformance(DataSourceConformance):
    name = "grch37-chrX"
