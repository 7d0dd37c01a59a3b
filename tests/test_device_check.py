"""benchmarks/device_check.py: its CPU rehearsal runs every part (the launches under Ray and torchrun, the memory
row against the CPU plan, the model's speed rows, the Triton kernels in the interpreter, the distributed
layouts on gloo processes), its guards turn a failing or over-budget check into a row while the rest still
runs, its distributed rows fail a run that differs from the one process, the model FLOPs it divides by are
the products the model computes, and a vllm engine that cannot start is a row with the command's error."""

from __future__ import annotations

import copy
import importlib.util
import json
import math
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


@pytest.mark.slow  # every part of the device check rehearsed on CPU: Ray and torchrun launches, gloo ranks
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the rehearsal runs Triton kernels")
def test_rehearsal_runs_every_part(tmp_path: Path) -> None:
    out = tmp_path / "device_check.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, str(SCRIPT), "--rehearse", "--out", str(out)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=700)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert not [r for r in rows if r["status"] not in ("pass", "skipped", "missing")]
    passed = {(r["part"], r["check"]) for r in rows if r["status"] == "pass"}
    ray = importlib.util.find_spec("ray") is not None
    # Everything the CPU can run did run (and passed); only CUDA-only checks, and vLLM where it is missing, are
    # skipped.
    for part, check in [
        *([("launch", "megaseq train --workers 1 under Ray")] if ray else []),
        ("launch", "megaseq train --workers 1 under torchrun"),
        ("memory", "host optimizer state + recompute + offload, T256, 3 steps"),
        ("model_speed", "kda megaseq triton B1 T64 H2 D16"),
        ("model_speed", "dsa triton select+sparse T64 top-k 16 pool 4"),
        ("model_speed", "dense causal torch SDPA (cpu) T64 H2 D8"),
        ("model_speed", "model d32 kda,kda,kda,dsa + chunked MoE T64"),
        ("model_speed", "model d32 kda,kda,kda,dsa + chunked MoE T128"),
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
    launches = [r for r in rows if r["part"] == "launch" and r["status"] == "pass"]
    assert all(r["ranks"][0]["parameter_devices"] == ["cpu"] and r["trainer_device"] == "cpu" for r in launches)
    memory = next(r for r in rows if r["part"] == "memory")
    assert abs(memory["error"]) <= 0.10 and memory["plan"]["runtime"] > 0 and len(memory["losses"]) == 3
    vllm = [r for r in rows if r["part"] == "vllm"]
    assert [r["check"] for r in vllm] == ["engine starts and serves (megaseq logprob-gap --engine vllm)",
                                         "logprob gap vllm vs trainer T64", "logprob gap vllm vs trainer T128"]
    if importlib.util.find_spec("vllm") is None:
        assert all(r["status"] == "skipped" and r["note"].startswith("vllm not installed") for r in vllm)
    else:
        assert all(r["status"] == "pass" for r in vllm), vllm
    speed = [r for r in rows if r["part"] == "model_speed" and r["check"].startswith("model ")]
    assert all(r["tokens_per_s"] > 0 and r["flops_per_token"]["train"] > 0 and r["mfu"] is None for r in speed)
    assert {r["part"] for r in rows if r["status"] == "pass"} == {
        "setup", "launch", "memory", "model_speed", "correctness", "kda_speed", "dsa_speed", "train", "distributed"}
    allowed = ("no CUDA", "vllm not installed", *(() if ray else ("ray missing",)))
    assert all(r["note"].startswith(allowed) for r in rows if r["status"] == "skipped")
    assert all(r["rehearsal"] for r in rows)
    assert all(r["measured"].startswith("rehearsal: ") for r in rows if r["status"] == "pass" and r["part"] != "setup")
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


def test_model_flops_are_the_products_the_model_computes(script, monkeypatch):
    """The formula's matrix products (projections, feed-forwards, the head) are what torch counts in a forward of
    the rehearsal's model; the attention cores (KDA's delta rule, DSA's selection and sparse attention), which the
    CPU reference implementations compute differently from the GPU kernels, and the depthwise convolution
    (elementwise), are left to the formula."""
    from torch.utils.flop_counter import FlopCounterMode

    import megaseq_moe.experts
    from megaseq.config import validate_recipe
    from megaseq.contracts import ForwardContext
    from megaseq.model import build_model

    # the routed experts through plain matrix products, which torch's counter counts (grouped_mm it does not)
    monkeypatch.setattr(megaseq_moe.experts, "grouped_mm_supported", lambda *args: False)
    env = script.Env(rehearse=True, sizes=script.REHEARSAL, device=torch.device("cpu"), work=Path("unused"))
    length = 256
    raw = script.model_recipe(env, length, Path("unused"))
    raw["attention"] = {"kda": {**raw["attention"]["kda"], "backend": "chunk"},
                        "dsa": {**raw["attention"]["dsa"], "backend": "torch"}}
    plugins = script.megaseq_plugins()
    recipe = validate_recipe(raw, plugins)
    model = build_model(recipe, plugins)
    tokens = torch.randint(0, 4, (1, length), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(tokens, ForwardContext()) @ model.head_weight.t()
    counted = counter.get_flop_counts()["Global"][torch.ops.aten.mm]
    flops = script.model_flops_per_token(recipe, length)
    products = ("kda projections", "dsa projections", "ffn", "moe", "head")
    # the chunked MoE scores its router twice (to choose, without gradient; then the weights): model FLOPs once
    moe, d = raw["moe"]["chunked"], raw["model"]["d_model"]
    router_again = (raw["model"]["n_layers"] - raw["model"]["dense_layers"]) * 2 * d * moe["n_experts"]
    assert counted == pytest.approx(length * (sum(flops[term] for term in products) + router_again), rel=1e-6)
    assert set(flops) == {*products, "kda convolution", "kda delta rule", "dsa sparse attention", "selection",
                          "forward", "train"}
    assert flops["train"] == pytest.approx(3 * flops["forward"] + flops["selection"])


@pytest.mark.parametrize(("length", "cap"), [(1, 4), (7, 4), (64, 64), (100, 16), (5, 100)])
def test_mean_seen_keys(script, length, cap):
    assert math.isclose(script._mean_seen(length, cap), sum(min(t + 1, cap) for t in range(length)) / length)


def test_the_model_speed_row_divides_by_the_gpu_peak_it_names(script):
    env = script.Env(rehearse=False, sizes=script.FULL, device=torch.device("cpu"))
    assert script.bf16_peak(env) == (None, "no GPU peak on the CPU")
    names = {"NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H100 PCIe": 756e12, "NVIDIA H200": 989e12,
             "NVIDIA H200 NVL": 835e12, "NVIDIA GH200 480GB": 989e12}
    for name, peak in names.items():
        assert next(p for key, p in script.BF16_PEAK if key in name) == peak, name


def test_the_gap_rows_read_the_commands_json_among_other_output(script):
    rows = [{"length": 64, "dtype": "bf16", "mean_abs": 0.01, "max_abs": 0.05},
            {"length": 128, "dtype": "bf16", "mean_abs": 0.03, "max_abs": 0.2, "routing_mismatch": 0.004}]
    output = ("INFO 12:00:01 engine.py:99] [warm-up]\n" + json.dumps(rows, indent=2)
              + "\nINFO 12:00:09 shutting down [done]\n")
    found = {row["length"]: row for row in script.last_json_list(output)}
    assert script.gap_row(found, 64)[0] == "pass"
    status, measured, _ = script.gap_row(found, 128)
    assert status == "FAIL" and "routing differs 0.40%" in measured
    with pytest.raises(script.Skip):
        script.gap_row(found, 4096)


@pytest.mark.slow  # a megaseq logprob-gap process
def test_a_vllm_engine_that_cannot_start_is_a_row_with_the_commands_error(script, tmp_path):
    """vLLM "installed" where it is not: the command runs on the model's initial weights and fails to start the
    engine; the row carries megaseq's one-line error and the gap rows say the engine did not run."""
    env = script.Env(rehearse=True, sizes=script.REHEARSAL, device=torch.device("cpu"), work=tmp_path,
                     found={"vllm": "0.33.0"})
    report = script.Report(tmp_path / "out.json", env)
    report.part("vllm", script.part_vllm)
    engine, *gaps = report.rows
    assert engine["status"] == "error" and engine["note"].startswith("RuntimeError: exit 2: megaseq: error: engine 'vllm' needs vLLM"), engine
    assert [(r["status"], r["note"]) for r in gaps] == [("skipped", "the engine did not run (the row above says why)")] * 2


def test_processes_the_check_starts_find_the_probe_and_the_checkouts_packages_as_installed(script, tmp_path):
    import importlib.metadata as md

    env = script.Env(rehearse=True, sizes=script.REHEARSAL, work=tmp_path,
                     found={"megaseq_rl": "0.1.0 (from source, not installed)", "megaseq_kda": "0.1.0"})
    script.write_distributions(env, tmp_path / "site")
    found = {d.metadata["Name"]: d for d in md.distributions(path=[str(tmp_path / "site")])}
    assert set(found) == {"megaseq-device-probe", "megaseq-rl"}  # kda is installed: found where it is
    points = {(e.group, e.name, e.value) for e in found["megaseq-rl"].entry_points}
    assert points == {("megaseq", "rl", "megaseq_rl.plugin"), ("vllm.general_plugins", "megaseq", "megaseq_rl.vllm.register:register")}
    assert found["megaseq-rl"].version == "0.1.0" and "megaseq-core>=0.1,<0.2" in found["megaseq-rl"].requires
    (probe,) = found["megaseq-device-probe"].entry_points
    assert (probe.group, probe.value) == ("megaseq", "device_probe") and (tmp_path / "site" / "device_probe.py").is_file()


def test_the_device_probe_records_the_ranks_device_after_its_first_step(script, tmp_path, monkeypatch):
    from types import SimpleNamespace

    spec = importlib.util.spec_from_file_location("device_probe", REPO / "benchmarks" / "device_probe.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    model = torch.nn.Linear(2, 2)
    probe.megaseq_step_end(SimpleNamespace(step=1), model, {})  # no directory named: nothing written
    monkeypatch.setenv(probe.PROBE_ENV, str(tmp_path))
    probe.megaseq_step_end(SimpleNamespace(step=2), model, {})
    assert not list(tmp_path.iterdir())  # the first step's record only
    probe.megaseq_step_end(SimpleNamespace(step=1), model, {})
    record = json.loads((tmp_path / "rank0.json").read_text())
    current = torch.cuda.current_device() if torch.cuda.is_available() else None
    assert record["rank"] == 0 and record["world_size"] == 1 and record["current_device"] == current
    assert record["parameter_devices"] == ["cpu"]
