"""benchmarks/device_check.py: its CPU rehearsal runs every part (the Triton kernels in the interpreter), and
its guards turn a failing or over-budget check into a row while the rest still runs."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "device_check.py"


def load_script():
    spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # every part of the device check rehearsed on CPU, gloo ranks included
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the rehearsal runs Triton kernels")
def test_rehearsal_runs_every_part(tmp_path: Path) -> None:
    out = tmp_path / "device_check.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, str(SCRIPT), "--rehearse", "--out", str(out)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert not [r for r in rows if r["status"] not in ("pass", "skipped", "missing")]
    passed = {(r["part"], r["check"]) for r in rows if r["status"] == "pass"}
    # Everything the interpreter can run did run (and passed); only CUDA-only checks are skipped.
    for part, check in [
        ("correctness", "kda triton fwd+bwd (chunk_kda_triton)"),
        ("correctness", "dsa triton top-k pool 4"),
        ("correctness", "dsa triton top-k pool 4, query positions"),
        ("correctness", "dsa triton sparse attention fwd+bwd"),
        ("correctness", "sdpa layer fwd+bwd, packed"),
        ("distributed", "dense tp=2"),
    ]:
        assert (part, check) in passed, (part, check)
    assert {r["part"] for r in rows if r["status"] == "pass"} == {"setup", "correctness", "kda_speed", "dsa_speed",
                                                                   "train", "distributed"}
    assert all(r["note"].startswith("no CUDA") for r in rows if r["status"] == "skipped")
    assert re.fullmatch(r"\d+ pass, 0 FAIL, 0 error, \d+ skipped, \d+ missing", done.stdout.splitlines()[-1])


def test_a_failing_check_is_a_row_and_the_rest_still_runs(tmp_path: Path) -> None:
    script = load_script()
    env = script.Env(rehearse=True, sizes=script.REHEARSAL)
    report = script.Report(tmp_path / "out.json", env)

    def part(env, report) -> None:
        report.check("raises", "fp32", lambda: 1 / 0)
        report.check("cannot run here", "bf16", lambda: (_ for _ in ()).throw(script.Skip("no CUDA")))
        report.check("too slow", "fp32", lambda: ("pass", "", {}), predicted_s=1e6)
        report.check("fine", "fp32", lambda: ("pass", "1 ms", {"x": 1}))
        raise RuntimeError("the part itself broke")

    report.part("kda_speed", part)
    report.write()
    rows = json.loads((tmp_path / "out.json").read_text())["rows"]
    assert [(r["check"], r["status"]) for r in rows] == [
        ("raises", "error"), ("cannot run here", "skipped"), ("too slow", "skipped"), ("fine", "pass"),
        ("(part)", "error"),
    ]
    assert rows[0]["note"] == "ZeroDivisionError: division by zero" and "Traceback" in rows[0]["traceback"]
    assert rows[2]["note"].startswith("budget: predicted 1000000s")
    assert rows[3]["x"] == 1 and rows[4]["note"] == "RuntimeError: the part itself broke"
