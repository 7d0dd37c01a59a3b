"""The kit's pytest plugin: the markers, and a cache of the test run's own (never the user's)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_this_run_writes_into_a_cache_of_its_own():
    cache = Path(os.environ["MEGASEQ_CACHE"])
    assert cache.name.startswith("megaseq-test-cache-") and cache != Path.home() / ".cache" / "megaseq"


def test_the_users_cache_is_untouched_and_fetched_data_is_linked(tmp_path):
    user = tmp_path / "user-cache"
    (user / "some-source").mkdir(parents=True)
    (user / "some-source" / "data.fa").write_text(">x\nACGT\n")
    (user / "trainers").mkdir()
    tests = tmp_path / "t"
    tests.mkdir()
    (tests / "test_inner.py").write_text(
        "import os\nfrom pathlib import Path\n"
        "def test_inner():\n"
        "    cache = Path(os.environ['MEGASEQ_CACHE'])\n"
        "    assert (cache / 'some-source' / 'data.fa').read_text().startswith('>x')\n"
        "    assert not (cache / 'trainers').exists()\n"
        "    (cache / 'trainers').mkdir()\n"
        "    (cache / 'tokens').mkdir()\n"
    )
    env = {**os.environ, "MEGASEQ_CACHE": str(user)}
    env.pop("MEGASEQ_TEST_CACHE", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in user.iterdir()) == ["some-source", "trainers"]
    assert list((user / "trainers").iterdir()) == []
    assert (user / "some-source" / "data.fa").is_file()  # the links were removed, not what they point at


def test_a_module_skipped_whole_fails_where_every_extra_is_installed(tmp_path):
    (tmp_path / "test_needs_extra.py").write_text(
        "import pytest\npytest.importorskip('a_module_nobody_has', reason='needs the imaginary extra')\n"
        "def test_x():\n    pass\n"
    )
    def run(every: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "MEGASEQ_TEST_EVERY_MODULE": every}
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)], env=env,
                              capture_output=True, text=True, timeout=300)

    skipped = run("0")  # a user without the extra: skipped (pytest's 5: no test ran), with the extra's name
    assert skipped.returncode == 5 and "1 skipped" in skipped.stdout, skipped.stdout
    failed = run("1")
    assert failed.returncode != 0 and "skipped whole (Skipped: needs the imaginary extra)" in failed.stdout, failed.stdout


def test_each_finished_file_is_one_progress_line(tmp_path):
    (tmp_path / "test_a.py").write_text("def test_1():\n    pass\ndef test_2():\n    assert False\n")
    (tmp_path / "test_b.py").write_text("def test_3():\n    pass\n")
    read, write = os.pipe()
    env = {**os.environ, "MEGASEQ_TEST_PROGRESS": "test-x", "MEGASEQ_TEST_PROGRESS_FD": str(write)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "."], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, pass_fds=(write,))  # file names relative to it
    os.close(write)
    with os.fdopen(read) as lines:
        progress = lines.read().splitlines()
    assert proc.returncode == 1  # test_2 fails
    assert [line.split(" (")[0] for line in progress] == [
        "test-x: test_a.py: 1 passed or skipped, 1 failed", "test-x: test_b.py: 1 passed or skipped, 0 failed"]
