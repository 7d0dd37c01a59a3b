"""megaseq.backends: a requested backend runs or fails in one line; auto is a logged choice, never silent."""

from __future__ import annotations

import logging

import pytest
import torch

from megaseq import backends as backends_module
from megaseq.backends import Backend, BackendError, Backends
from megaseq.errors import UserError

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def make(installed: set[str], monkeypatch: pytest.MonkeyPatch) -> Backends:
    monkeypatch.setattr(backends_module, "is_installed", lambda module: module in installed)
    return Backends(
        "attention.thing",
        [
            Backend("torch", load=lambda: "torch op"),
            Backend("kernels", load=lambda: "kernel op", requires=("kernellib",), install="pip install kernellib",
                    devices=("cuda",), interpretable=True),
            Backend("vendor", load=lambda: "vendor op", requires=("vendorlib",), install="pip install vendorlib",
                    devices=("cuda",)),
        ],
        auto=("kernels", "vendor", "torch"),
    )


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


def test_requested_backend_missing_its_package_fails_at_check(monkeypatch):
    chooser = make(set(), monkeypatch)
    with pytest.raises(BackendError) as exc:
        chooser.check("vendor")
    assert one_line(exc) == (
        "attention.thing: backend 'vendor' needs vendorlib, which is not installed (pip install vendorlib)"
    )
    assert isinstance(exc.value, UserError) and isinstance(exc.value, ValueError)
    chooser.check("torch")
    chooser.check("auto")


def test_unknown_backend_lists_the_allowed_names(monkeypatch):
    with pytest.raises(BackendError) as exc:
        make(set(), monkeypatch).check("cuda")
    assert one_line(exc).endswith("unknown backend 'cuda'; allowed: auto, torch, kernels, vendor")


def test_requested_backend_on_a_device_it_cannot_run_on_is_an_error_not_a_fallback(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    chooser = make({"kernellib", "vendorlib"}, monkeypatch)
    for name in ("kernels", "vendor"):
        with pytest.raises(BackendError, match=f"backend '{name}' needs cuda tensors, got cpu") as exc:
            chooser.load(name, CPU)
        assert "backends that run there: torch" in one_line(exc)
    assert chooser.load("vendor", CUDA) == "vendor op"
    assert chooser.load("torch", CUDA) == "torch op"


def test_interpretable_backend_runs_on_cpu_under_the_triton_interpreter(monkeypatch):
    chooser = make({"kernellib", "vendorlib"}, monkeypatch)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert chooser.load("kernels", CPU) == "kernel op"
    with pytest.raises(BackendError):
        chooser.load("vendor", CPU)
    assert chooser.select("auto", CPU).name == "torch"  # the interpreter is for tests: auto never picks it


@pytest.mark.parametrize(
    ("installed", "device", "expected", "passed_over"),
    [
        ({"kernellib", "vendorlib"}, CUDA, "kernels", ""),
        ({"vendorlib"}, CUDA, "vendor", "kernels: kernellib not installed"),
        (set(), CUDA, "torch", "kernels: kernellib not installed; vendor: vendorlib not installed"),
        ({"kernellib", "vendorlib"}, CPU, "torch", "kernels: does not run on cpu; vendor: does not run on cpu"),
    ],
)
def test_auto_is_a_logged_choice(monkeypatch, caplog, installed, device, expected, passed_over):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    chooser = make(installed, monkeypatch)
    with caplog.at_level(logging.INFO, logger="megaseq.backends"):
        assert chooser.select("auto", device).name == expected
        chooser.select("auto", device)  # logged once, not at every call
    [record] = caplog.records
    assert f"attention.thing: backend 'auto' chose {expected!r} on {device.type}" in record.getMessage()
    assert passed_over in record.getMessage()


def test_auto_with_nothing_runnable_is_an_error(monkeypatch):
    chooser = Backends("ffn.thing", [Backend("gpu", load=lambda: None, devices=("cuda",))], auto=("gpu",))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(BackendError, match=r"ffn.thing: no backend runs on cpu \(gpu: does not run on cpu\)"):
        chooser.select("auto", CPU)


def test_declaration_mistakes_are_caught():
    op = Backend("torch", load=lambda: None)
    with pytest.raises(ValueError, match="unique"):
        Backends("x", [op, op], auto=("torch",))
    with pytest.raises(ValueError, match="auto order"):
        Backends("x", [op], auto=("triton",))


def test_a_backend_that_cannot_run_here_says_why_when_requested_and_is_passed_over_by_auto(monkeypatch, caplog):
    """``unavailable`` (a compiler that must build the kernels, say): a requested backend fails in one line
    with its reason; auto logs the reason and takes the next one; a backend whose check passes is taken."""
    monkeypatch.setattr(backends_module, "is_installed", lambda module: True)
    reason: list[str | None] = ["no C compiler"]
    chooser = Backends(
        "attention.thing",
        [Backend("torch", load=lambda: "torch op"),
         Backend("native", load=lambda: "native op", devices=("cpu",), unavailable=lambda: reason[0])],
        auto=("native", "torch"),
    )
    with pytest.raises(BackendError) as exc:
        chooser.check("native")
    assert one_line(exc) == "attention.thing: backend 'native' cannot run here: no C compiler"
    with caplog.at_level(logging.INFO, logger="megaseq.backends"):
        assert chooser.load("auto", CPU) == "torch op"
    assert "passed over: native: no C compiler" in caplog.text
    reason[0] = None
    assert chooser.load("auto", CPU) == "native op" and chooser.load("native", CPU) == "native op"
