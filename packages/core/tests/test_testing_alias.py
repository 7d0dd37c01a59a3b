"""``megaseq.testing``, the kit's name in megaseq-core 0.1, serves megaseq_testkit's own modules and warns."""

from __future__ import annotations

import subprocess
import sys


def test_old_import_warns_and_is_the_kit() -> None:
    code = (
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    from megaseq.testing.attention import AttentionConformance\n"
        "    from megaseq.testing import fresh_plugins\n"
        "import megaseq_testkit, megaseq_testkit.attention\n"
        "assert AttentionConformance is megaseq_testkit.attention.AttentionConformance\n"
        "assert fresh_plugins is megaseq_testkit.fresh_plugins\n"
        "moved = [w for w in caught if issubclass(w.category, DeprecationWarning) and 'megaseq-testkit' in str(w.message)]\n"
        "assert len(moved) == 1, [str(w.message) for w in caught]\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
