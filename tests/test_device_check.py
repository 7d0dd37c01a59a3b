"""benchmarks/device_check.py: its CPU rehearsal runs every part (the Triton kernels in the interpreter, the
distributed layouts on gloo processes), its guards turn a failing or over-budget check into a row while the
rest still runs, and its distributed rows fail a run that differs from the one process."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
                          capture_output=True, text=True, timeout=400)
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
        ("distributed", "hybrid tp=2"),
        ("distributed", "hybrid cp=2"),
        ("distributed", "hybrid dp=2 x ep=2"),
        ("distributed", "hybrid tp=2 x cp=2"),
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


@pytest.fixture(scope="module")
def script():
    return load_script()


@pytest.fixture(scope="module")
def one_process(script):
    """The distributed rows' one-process run, as the rehearsal trains it."""
    return script.DistRuns(script.Env(rehearse=True, sizes=script.REHEARSAL, device=torch.device("cpu"))).one_process()


def test_distributed_rows_train_the_layout_tests_hybrid_recipe(script, layouts_recipe):
    # the recipe tests/test_distributed.py and tests/test_expert_tensor_parallel.py hold to 1e-5 on gloo
    ours = script.DIST_RECIPE
    assert ours["data"] == {k: v for k, v in layouts_recipe["data"].items() if k != "seq_len"}
    assert {k: v for k, v in ours.items() if k != "data"} == {
        k: v for k, v in layouts_recipe.items() if k not in ("data", "run", "eval")}


def test_a_distributed_row_fails_a_perturbed_weight_metric_or_token_count(script, one_process):
    tol = script.DIST_TOLERANCE["cpu"]
    status, measured, data = script.judge(copy.deepcopy(one_process), one_process, tol, "gloo")
    assert status == "pass" and max(data["differences"].values()) == 0.0, measured
    assert {"tokens", "step 2 loss", "step 2 grad_norm"} <= set(data["differences"])

    name = next(n for n in sorted(one_process["weights"]) if ".experts." in n)  # what expert parallelism splits
    for scale, expected in ((0.5, "pass"), (3.0, "FAIL")):  # a step of 0.5 and 3 tolerances in one element
        wrong = copy.deepcopy(one_process)
        weight = wrong["weights"][name]
        weight.view(-1)[7] += scale * tol * max(1.0, weight.abs().max().item())
        status, measured, _ = script.judge(wrong, one_process, tol, "gloo")
        assert status == expected, measured
    assert f"(weight {name})" in measured and measured.startswith("gloo: max rel diff 3.00e-05"), measured

    wrong = copy.deepcopy(one_process)
    wrong["metrics"][1]["grad_norm"] *= 1 + 1e-4
    status, measured, _ = script.judge(wrong, one_process, tol, "gloo")
    assert status == "FAIL" and "(step 2 grad_norm)" in measured, measured

    wrong = copy.deepcopy(one_process)
    wrong["tokens"] += 1
    status, measured, _ = script.judge(wrong, one_process, tol, "gloo")
    assert status == "FAIL" and "inf (tokens)" in measured, measured

    wrong = copy.deepcopy(one_process)
    wrong["weights"][name].view(-1)[0] = float("nan")
    assert script.judge(wrong, one_process, tol, "gloo")[0] == "FAIL"


def test_a_layout_needing_more_gpus_than_visible_is_a_skipped_row_saying_so(script, tmp_path):
    # a CUDA machine as the check sees it (no CUDA call happens before the GPUs are counted)
    env = script.Env(rehearse=False, sizes=script.FULL, device=torch.device("cuda"))
    report = script.Report(tmp_path / "out.json", env)
    runs = script.DistRuns(env)

    def part(env, report) -> None:
        report.check("hybrid tp=2 x cp=2", "fp32", lambda: script.dist_equivalence(runs, 2, {"tp": 2, "cp": 2}))
        report.check("hybrid cp=2", "fp32", lambda: script.dist_equivalence(runs, 1, {"cp": 2}))

    report.part("distributed", part)
    assert [(r["check"], r["status"], r["note"]) for r in report.rows] == [
        ("hybrid tp=2 x cp=2", "skipped", "needs 4 GPUs for NCCL, 2 visible"),
        ("hybrid cp=2", "skipped", "needs 2 GPUs for NCCL, 1 visible"),
    ]
    assert "skipped  " in report.table() and "needs 4 GPUs for NCCL, 2 visible" in report.table()
    assert not runs.single and not runs.launches  # nothing was trained
