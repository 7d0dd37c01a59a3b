"""The GRCh37 chromosomes as data sources, taken out of Debian example packages.

Taking them from Debian packages means no network service beyond the distribution mirror is needed: a fetch
uses the cache, then an installed copy under /usr/share/doc, then ``apt-get download`` + ``dpkg-deb -x``
(neither needs root). Core tokenises the FASTA and checks its base counts against the record
(``megaseq.data.sources``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from megaseq.data.errors import DataError
from megaseq.data.sources import progress
from megaseq.records import FetchRequest

# Installed Debian packages put their files here; tests point it at a temporary directory.
SYSTEM_ROOT = Path("/")


@dataclass(frozen=True)
class DebianFile:
    """A FASTA file ``member`` (a path inside the package) of the Debian package ``package``."""

    name: str
    package: str
    member: str


CHR20 = DebianFile("grch37-chr20", "vt-examples", "usr/share/doc/vt/examples/ref/20.fa.gz")
CHRX = DebianFile("grch37-chrX", "smalt-examples", "usr/share/doc/smalt/test/data/hs37chrXtrunc.fa.gz")


DEBIAN_FILES = {info.name: info for info in (CHR20, CHRX)}


def fetch(request: FetchRequest) -> Path:
    """The target of both data sources: the chromosome the record ``request.name`` names (GRCh37 chromosome 20,
    or the first 70 Mb of chromosome X); they take no config."""
    return fetch_debian(DEBIAN_FILES[request.name], request.cache_dir)


def fetch_debian(info: DebianFile, cache_dir: Path) -> Path:
    """Local path of ``info``'s file: the cached copy, the installed package's, or extracted into the cache."""
    target = cache_dir / info.name / PurePosixPath(info.member).name
    if target.is_file():
        return target
    installed = SYSTEM_ROOT / info.member
    if installed.is_file():
        progress(f"{info.name}: using {installed} from the installed Debian package {info.package}")
        return installed
    return _extract(info, target)


def _extract(info: DebianFile, target: Path) -> Path:
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
        progress(f"{info.name}: apt-get download {info.package}")
        _run(["apt-get", "download", info.package], Path(tmp), info, advice)
        debs = sorted(Path(tmp).glob(f"{info.package}_*.deb"))
        if not debs:
            raise DataError(f"cannot fetch {info.name}: apt-get produced no {info.package} .deb; {advice}")
        progress(f"{info.name}: extracting {debs[0].name}")
        _run(["dpkg-deb", "-x", str(debs[0]), "root"], Path(tmp), info, advice)
        extracted = Path(tmp) / "root" / info.member
        if not extracted.is_file():
            raise DataError(f"cannot fetch {info.name}: {debs[0].name} has no {info.member}; {advice}")
        index = extracted.with_name(extracted.name + ".fai")
        if index.is_file():
            os.replace(index, target.with_name(target.name + ".fai"))
        os.replace(extracted, target)
    progress(f"{info.name}: {target} ready in {time.perf_counter() - started:.1f} s")
    return target


def _run(command: list[str], cwd: Path, info: DebianFile, advice: str) -> None:
    result = subprocess.run(command, check=False, cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        lines = (result.stderr or result.stdout).strip().splitlines()
        reason = lines[-1] if lines else f"exit status {result.returncode}"
        raise DataError(f"cannot fetch {info.name}: `{' '.join(command)}` failed ({reason}); {advice}")
