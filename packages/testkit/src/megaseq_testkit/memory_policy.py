"""Conformance suite for memory policies (see ``megaseq.contracts.MemoryPolicy``).

Subclass :class:`MemoryPolicyConformance` in a pytest module and set ``name`` (an installed policy) and
``config`` (its ``[memory_policy.NAME]`` table). The suite trains a small model (``recipe``: core's ``sdpa``
attention, which tiles and runs under context parallelism, and the suite's own ``memory-probe``
feed-forward, which adds an auxiliary loss, logs a metric, draws noise from the global RNG and counts its
forwards) for two optimizer steps of two micro-batches of packed documents, once with the policy and once
without, and checks:

- the same loss, auxiliary losses, metrics and parameter gradients (the probe's noise must be replayed:
  ``probe_noise = False`` only for a policy that calls a feed-forward a different number of times, such as
  sequence tiling, which calls it once per tile): bitwise when ``exact`` (the policy keeps the order of
  operations); a lossy policy (``exact = False``, e.g. bf16 copies of what it saves) declares its bound
  ``tolerance`` and is held to it on the relative error of the loss, of each auxiliary loss and metric, and of
  the whole gradient vector, ``||g - g_ref|| / ||g_ref||`` (a bound per parameter would trip on a parameter
  whose gradient is tiny, where rounding is relatively large but harmless);
- the same with two micro-batches' forwards run before one backward of both (a policy that keys what it
  keeps per layer and call collides);
- forwards outside ``step()`` (evaluation) and forwards under ``torch.no_grad()`` inside it give the outputs
  of the model without the policy (a policy that needs ``step()``'s resources in every forward, or that
  changes what a no-grad forward computes);
- every token through each layer's forward once per micro-batch (a re-run for recomputation does not
  count; a policy may split a forward into tiles);
- after every step, and after a step that fails half-way through the forward, nothing of the step is
  left: no saved-tensor hooks installed, no file descriptors open, nothing in the scratch directory
  (``$MEGASEQ_SCRATCH`` points at an empty directory for the test), and no more tensor memory reachable
  than before the step;
- ``test_memory_effect``: the policy's declared ``MemoryEffect`` (its record's ``memory`` target; with
  ``factory``, the ``memory`` knob) against what applying it does: the bytes one forward leaves alive for
  backward in the model's layers (measured with ``megaseq_testkit.checks``'s allocation tracker: what the
  forward allocates and still holds when it returns, on the device, so a tensor moved to a scratch file or
  host memory does not count), without the policy and with it. What the planner
  (``megaseq.memory.plan.estimate``) predicts the effect saves of what the layers keep must match what the
  policy saves within ``effect_ratio`` (2x either way, give or take a tenth of what the layers keep without
  it: the planner models a layer's parts, not each small tensor). A policy that declares a recomputation or an
  offload it does not do, or does one it does not declare, is caught. What is not measurable in one forward
  on CPU is not checked: ``maps_allocations_from`` (the C library's heap) and the time costs.
- under context parallelism (``cp_world_sizes``, 2 gloo ranks by default) the same equality against
  the same ranks without the policy, when the record declares ``context_parallel``
  (``megaseq.records.CAPABILITIES``) and this config does not tile sequences
  (``megaseq.capabilities.policy_runs_under``, the rule the launch applies); otherwise the policy must
  raise a one-line error there, which is checked.

The policy comes from the installed plugins; ``factory = "module:attr"`` (or ``"/path/to/file.py:attr"``) of
a ``build(config_dict)`` tests one that is not an installed plugin (a policy before it is packaged, core's
own wrong policies), with ``capabilities`` the ones it would declare. It is named by import path because the context-parallel test rebuilds the suite in
fresh processes.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megaseq.capabilities import policy_effect, policy_runs_under
from megaseq.config import validate_recipe
from megaseq.contracts import ContextParallel, ForwardContext, MemoryPolicy
from megaseq.distributed.layout import Layout
from megaseq.errors import UserError
from megaseq.hookspecs import hookimpl
from megaseq.memory.machine import Machine
from megaseq.memory.plan import PolicyChoice, estimate
from megaseq.model import LanguageModel, build_model, chunked_token_losses
from megaseq.parallel import zigzag_shard
from megaseq.plugins import Plugins
from megaseq.records import ComponentConfig, FFNSpec, MemoryEffect, MemoryEstimate, ModelDims
from megaseq_testkit import env, load_factory

PROBE_LOSS, PROBE_METRIC = "memory_probe", "memory_probe_abs"


class ProbeConfig(ComponentConfig):
    hidden: int = 24
    noise: bool = True  # scale the output by 1 + 0.1 u, u drawn from the global RNG once per forward
    fail_after_tokens: int | None = None  # raise in the forward that takes the token count past this


class MemoryProbe(nn.Module):
    """A dense feed-forward that exercises what a memory policy must preserve: an auxiliary loss (a sum over
    tokens, so tiles add up), a metric (a per-token mean), noise from the global RNG (recomputation must
    replay it) and counts of its forwards and of the tokens they saw, which skip re-runs for recomputation
    (``ctx.recomputing``)."""

    def __init__(self, d_model: int, config: ProbeConfig) -> None:
        super().__init__()
        self.up = nn.Linear(d_model, config.hidden, bias=False)
        self.down = nn.Linear(config.hidden, d_model, bias=False)
        self.noise = config.noise
        self.fail_after = config.fail_after_tokens
        self.forwards = 0
        self.tokens = 0

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        if not ctx.recomputing:
            self.forwards += 1
            self.tokens += x.shape[0] * x.shape[1]
            if self.fail_after is not None and self.tokens > self.fail_after:
                raise RuntimeError("memory-probe: the planned failure half-way through a step")
        out = self.down(F.silu(self.up(x)))
        if self.noise:
            out = out * (1 + 0.1 * torch.rand((), dtype=x.dtype, device=x.device))
        ctx.add_loss(PROBE_LOSS, 1e-3 * out.square().sum())
        ctx.log(PROBE_METRIC, out.abs().mean())
        return out


def _build_probe(config: ProbeConfig, dims: ModelDims, layer_idx: int) -> MemoryProbe:
    return MemoryProbe(dims.d_model, config)


def _probe_memory(config: ProbeConfig, dims: ModelDims, seq_len: int) -> MemoryEstimate:
    return MemoryEstimate(parameters=8 * dims.d_model * config.hidden, saved_per_token=4 * (dims.d_model + 3 * config.hidden))


class _ProbePlugin:
    @hookimpl
    def megaseq_ffn(self) -> list[FFNSpec]:
        return [
            FFNSpec(
                name="memory-probe",
                target="megaseq_testkit.memory_policy:_build_probe",
                config=ProbeConfig,
                summary="test feed-forward of the memory-policy suite",
                memory="megaseq_testkit.memory_policy:_probe_memory",
            )
        ]


def suite_plugins() -> Plugins:
    """The installed plugins and the suite's probe, in a fresh manager."""
    from megaseq_testkit import fresh_plugins

    plugins = fresh_plugins(autoload=True)
    plugins.register(_ProbePlugin(), name="memory-probe", dist="megaseq-core (testing)")
    return plugins


def _hooks_installed() -> bool:
    # torch has no public query for the installed default saved-tensor hooks; this is what
    # torch.autograd.graph.saved_tensors_hooks pushes and pops
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def _open_fds() -> set[str]:
    fd_dir = Path("/proc/self/fd")
    if not fd_dir.exists():
        return set()
    out = set()
    for fd in fd_dir.iterdir():
        with contextlib.suppress(OSError):
            out.add(f"{fd.name}->{os.readlink(fd)}")
    return out


def _tensor_bytes() -> int:
    """Bytes of all distinct tensor storages reachable from Python objects."""
    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        if issubclass(type(obj), Tensor) and not obj.is_meta:  # type(): some objects warn on __class__
            with contextlib.suppress(Exception):
                storage = obj.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
    return total


def _batch(step: int, micro: int, seq_len: int, vocab: int) -> Tensor:
    gen = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randint(0, vocab, (1, seq_len + 1), generator=gen)


@contextlib.contextmanager
def _scratch() -> Iterator[str]:
    """A fresh scratch directory as the policy's ``MEGASEQ_SCRATCH``, removed afterwards (with what a wrong
    policy left in it: the release checks look inside before that)."""
    with tempfile.TemporaryDirectory(prefix="megaseq-suite-") as scratch, env(MEGASEQ_SCRATCH=scratch):
        yield scratch


class MemoryPolicyConformance:
    """Base class of a memory policy's conformance tests."""

    name: ClassVar[str]
    config: ClassVar[dict[str, Any]] = {}
    recipe: ClassVar[dict[str, Any]] = {
        "model": {"d_model": 16, "n_layers": 3, "layer_pattern": ["sdpa"], "ffn": "memory-probe"},
        "attention": {"sdpa": {"n_heads": 2}},
    }
    factory: ClassVar[str | None] = None
    exact: ClassVar[bool] = True
    tolerance: ClassVar[float] = 1e-6
    seq_len: ClassVar[int] = 67
    doc_lengths: ClassVar[tuple[int, ...]] = (20, 1, 29, 17)
    micro_batches: ClassVar[int] = 2
    steps: ClassVar[int] = 2
    cp_world_sizes: ClassVar[tuple[int, ...]] = (2,)
    cp_seq_len: ClassVar[int] = 68
    probe_noise: ClassVar[bool] = True
    capabilities: ClassVar[frozenset[str] | None] = None  # with factory: what the policy would declare
    memory: ClassVar[str | None] = None  # with factory: its effect(config_dict) -> MemoryEffect
    effect_ratio: ClassVar[float] = 2.0

    # -- building -----------------------------------------------------------------------------------------
    def suite_plugins(self) -> Plugins:
        cls = type(self)
        if "_resolved_plugins" not in cls.__dict__:
            cls._resolved_plugins = suite_plugins()
        return cls._resolved_plugins

    def settings(self) -> dict[str, Any]:
        """The class attributes that define this suite (plain data, sent to context-parallel ranks)."""
        knobs = {name for klass in type(self).__mro__ for name in getattr(klass, "__annotations__", {})}
        return {key: getattr(self, key) for key in knobs if not key.startswith("_")}

    def model_recipe(self, probe: dict[str, Any] | None = None) -> Any:
        raw = {"run": {"device": "cpu"}, **copy.deepcopy(self.recipe)}
        if raw["model"].get("ffn") == "memory-probe":
            raw.setdefault("ffn", {})["memory-probe"] = {"noise": self.probe_noise, **(probe or {})}
        return validate_recipe(raw, self.suite_plugins(), source=f"<{self.name} conformance>")

    def build_policy(self) -> MemoryPolicy:
        if self.factory is not None:
            return load_factory(self.factory)(dict(self.config))
        provided = self.suite_plugins().get("memory_policy", self.name)
        return provided.load()(provided.spec.config(**self.config))

    def build(self, with_policy: bool, probe: dict[str, Any] | None = None) -> tuple[LanguageModel, MemoryPolicy | None]:
        torch.manual_seed(0)
        model = build_model(self.model_recipe(probe), self.suite_plugins())
        policy = None
        if with_policy:
            policy = self.build_policy()
            policy.apply(model)
        return model, policy

    def cu_seqlens(self) -> Tensor:
        assert sum(self.doc_lengths) == self.seq_len, "doc_lengths must add up to seq_len"
        return torch.tensor([0, *torch.tensor(self.doc_lengths).cumsum(0).tolist()], dtype=torch.int32)

    # -- one step ----------------------------------------------------------------------------------------
    def train_step(self, model: LanguageModel, policy: MemoryPolicy | None, step: int) -> dict[str, Any]:
        """Loss, auxiliary losses, metrics (summed over micro-batches) and gradients of one step."""
        model.zero_grad(set_to_none=True)
        losses, aux, metrics = [], {}, {}
        with policy.step() if policy is not None else contextlib.nullcontext():
            for micro in range(self.micro_batches):
                tokens = _batch(step, micro, self.seq_len, model.dims.vocab_size)
                ctx = ForwardContext(cu_seqlens=self.cu_seqlens())
                hidden = model(tokens[:, :-1], ctx)
                loss = chunked_token_losses(hidden, model.head_weight, tokens[:, 1:], 32).mean()
                (loss + sum(ctx.losses.values(), torch.zeros(()))).backward()
                losses.append(loss.detach())
                for k, v in ctx.losses.items():
                    aux[k] = aux.get(k, 0.0) + v.detach()
                for k, v in ctx.metrics.items():
                    metrics[k] = metrics.get(k, 0.0) + v
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return {"loss": torch.stack(losses), "aux": aux, "metrics": metrics, "grads": grads}

    def run(self, with_policy: bool, probe: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        model, policy = self.build(with_policy, probe)
        torch.manual_seed(1)  # the probe's noise
        out = []
        for step in range(self.steps):
            out.append(self.train_step(model, policy, step))
            for p in model.parameters():  # a plain SGD step, so the second step starts from new weights
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-0.1)
            out[-1]["tokens"] = [m.tokens for m in model.modules() if isinstance(m, MemoryProbe)]
        return out

    # -- comparisons -------------------------------------------------------------------------------------
    def assert_same(self, got: Tensor, ref: Tensor, what: str) -> None:
        """Bitwise when ``exact``; else ``||got - ref|| <= tolerance * ||ref||`` (the tensor as one vector)."""
        assert got.shape == ref.shape, f"{self.name}: {what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
        if self.exact:
            assert torch.equal(got, ref), (
                f"{self.name}: {what} differs from the run without the policy (max abs difference "
                f"{(got.double() - ref.double()).abs().max().item():.3e}); set exact = False and state the bound "
                "(tolerance) if the policy changes the order of operations or rounds what it keeps"
            )
            return
        err, norm = (got.double() - ref.double()).norm().item(), ref.double().norm().item()
        assert err <= self.tolerance * norm, (
            f"{self.name}: {what}: relative error {err / max(norm, 1e-300):.3e} > tolerance {self.tolerance:.1e}"
        )

    def compare(self, got: list[dict[str, Any]], ref: list[dict[str, Any]], where: str = "") -> None:
        for step, (g, r) in enumerate(zip(got, ref, strict=True)):
            at = f"step {step + 1}{where}"
            self.assert_same(g["loss"], r["loss"], f"{at} loss")
            assert set(g["aux"]) == set(r["aux"]), f"{self.name}: {at} auxiliary losses {sorted(g['aux'])} != {sorted(r['aux'])}"
            for k in r["aux"]:
                self.assert_same(g["aux"][k], r["aux"][k], f"{at} auxiliary loss {k!r} (counted once?)")
            assert set(g["metrics"]) == set(r["metrics"]), f"{self.name}: {at} metrics {sorted(g['metrics'])} != {sorted(r['metrics'])}"
            for k in r["metrics"]:
                self.assert_same(torch.tensor(g["metrics"][k]), torch.tensor(r["metrics"][k]), f"{at} metric {k!r} (counted once?)")
            assert set(g["grads"]) == set(r["grads"]), (
                f"{self.name}: {at}: gradients of {sorted(set(r['grads']) ^ set(g['grads']))} missing or extra"
            )
            if self.exact:
                for n, v in r["grads"].items():
                    self.assert_same(g["grads"][n], v, f"{at} gradient of {n}")
            else:  # the whole gradient vector: the bound a lossy policy states
                names = sorted(r["grads"])
                vectors = [torch.cat([grads[n].double().flatten() for n in names]) for grads in (g["grads"], r["grads"])]
                self.assert_same(*vectors, f"{at} gradient vector")

    def two_forwards_step(self, model: LanguageModel, policy: MemoryPolicy | None) -> dict[str, Any]:
        """One step whose micro-batches all run forward before one backward of their summed losses."""
        model.zero_grad(set_to_none=True)
        losses, aux, metrics, total = [], {}, {}, torch.zeros(())
        with policy.step() if policy is not None else contextlib.nullcontext():
            for micro in range(self.micro_batches):
                tokens = _batch(3, micro, self.seq_len, model.dims.vocab_size)
                ctx = ForwardContext(cu_seqlens=self.cu_seqlens())
                loss = chunked_token_losses(model(tokens[:, :-1], ctx), model.head_weight, tokens[:, 1:], 32).mean()
                total = total + loss + sum(ctx.losses.values(), torch.zeros(()))
                losses.append(loss.detach())
                for k, v in ctx.losses.items():
                    aux[k] = aux.get(k, 0.0) + v.detach()
                for k, v in ctx.metrics.items():
                    metrics[k] = metrics.get(k, 0.0) + v
            total.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return {"loss": torch.stack(losses), "aux": aux, "metrics": metrics, "grads": grads}

    def no_grad_outputs(self, model: LanguageModel, policy: MemoryPolicy | None) -> list[Tensor]:
        """Hidden states of forwards under ``torch.no_grad()``: two outside ``step()`` (evaluation), then two
        inside it (a rollout's old log-probabilities), each on its own batch."""
        outs = []

        def forward(seed: int) -> Tensor:
            tokens = _batch(seed, 0, self.seq_len, model.dims.vocab_size)
            try:
                with torch.no_grad():
                    return model(tokens[:, :-1], ForwardContext(cu_seqlens=self.cu_seqlens()))
            except Exception as exc:
                where = "inside" if len(outs) >= 2 else "outside"
                raise AssertionError(f"{self.name}: a no-grad forward {where} step() raised: {exc!r}") from exc

        outs += [forward(11), forward(12)]
        with policy.step() if policy is not None else contextlib.nullcontext():
            outs += [forward(13), forward(14)]
        return outs

    def declared_effect(self) -> MemoryEffect | None:
        """What the planner models the policy as: its record's ``memory`` target, or with ``factory`` the
        ``memory`` knob's ``effect(config_dict)``; ``None`` when there is none."""
        if self.factory is not None:
            return None if self.memory is None else load_factory(self.memory)(dict(self.config))
        provided = self.suite_plugins().get("memory_policy", self.name)
        return policy_effect(provided.spec, provided.spec.config(**self.config))

    def kept_by_layers(self, with_policy: bool) -> int:
        """Bytes one forward of a micro-batch leaves alive on the device for backward (the storages it allocates
        and still holds when it returns, less its output), with or without the policy, inside ``step()``."""
        from megaseq_testkit.checks import _Allocations

        model, policy = self.build(with_policy)
        torch.manual_seed(1)  # the probe's noise
        tokens = _batch(0, 0, self.seq_len, model.dims.vocab_size)
        tracker = _Allocations()
        with policy.step() if policy is not None else contextlib.nullcontext():
            with tracker:
                hidden = model(tokens[:, :-1], ForwardContext(cu_seqlens=self.cu_seqlens()))
            gc.collect()
            alive = tracker.alive_bytes() - hidden.untyped_storage().nbytes()
            del hidden
        tracker.refs.clear()
        return alive

    def planned_kept(self, effect: MemoryEffect | None) -> int:
        """What the planner says the layers keep for one micro-batch of the suite's model, under ``effect``."""
        recipe = self.model_recipe()
        recipe = recipe.model_copy(update={"train": recipe.train.model_copy(update={"batch_size": 1})})
        choices = [PolicyChoice(self.name, dict(self.config), effect)] if effect is not None else []
        planned = estimate(recipe, self.suite_plugins(), choices, Layout(), Machine("cpu", 2**50, None), self.seq_len)
        return sum(kept for kind, kept in planned.saved_by_kind.items() if kind != "embedding+head")

    # -- the tests ---------------------------------------------------------------------------------------
    def test_memory_effect(self) -> None:
        effect = self.declared_effect()
        if effect is None:
            pytest.skip(f"{self.name}: no memory effect (the record's memory target, or the suite's memory knob)")
        try:
            planned_without, planned_with = self.planned_kept(None), self.planned_kept(effect)
        except UserError as exc:  # a recipe knob whose components the planner cannot model
            pytest.skip(f"{self.name}: the suite's model cannot be planned: {exc}")
        with _scratch():
            measured_without, measured_with = self.kept_by_layers(False), self.kept_by_layers(True)
        declared, saved = planned_without - planned_with, measured_without - measured_with
        slack = measured_without / 10
        low, high = declared / self.effect_ratio - slack, declared * self.effect_ratio + slack
        assert low <= saved <= high, (
            f"{self.name} MemoryEffect: the planner takes {_summary(effect)} to save {declared} bytes of the {planned_without} "
            f"the layers keep between forward and backward, applying the policy saves {saved} of {measured_without} "
            f"(bound {max(low, 0):.0f} to {high:.0f} bytes: 1/{self.effect_ratio:g}x to {self.effect_ratio:g}x of the "
            f"declared saving, give or take a tenth of what the layers keep): fix the policy's memory effect"
        )

    def test_is_a_memory_policy(self) -> None:
        _, policy = self.build(with_policy=True)
        assert isinstance(policy, MemoryPolicy), f"{self.name}: build(config) did not return a MemoryPolicy (apply, step)"

    def test_same_loss_gradients_losses_and_metrics(self) -> None:
        with _scratch():
            self.compare(self.run(with_policy=True), self.run(with_policy=False))

    def test_two_forwards_before_one_backward(self) -> None:
        with _scratch():
            results = []
            for with_policy in (True, False):
                model, policy = self.build(with_policy)
                torch.manual_seed(1)  # the probe's noise
                results.append(self.two_forwards_step(model, policy))
        self.compare([results[0]], [results[1]], where=", two forwards before one backward")

    def test_forwards_outside_step_and_without_grad(self) -> None:
        with _scratch() as scratch:
            outputs = []
            for with_policy in (True, False):
                model, policy = self.build(with_policy)
                model.eval()
                torch.manual_seed(1)
                fds = _open_fds()
                outputs.append(self.no_grad_outputs(model, policy))
                if with_policy:
                    self._check_released(scratch, fds, None, "after forwards outside step() and under no_grad")
        labels = ["outside step(), no_grad", "outside step(), no_grad, second batch", "inside step(), no_grad",
                  "inside step(), no_grad, second batch"]
        for label, got, ref in zip(labels, *outputs, strict=True):
            self.assert_same(got, ref, f"hidden states of a forward {label}")

    def test_each_forward_counted_once(self) -> None:
        with _scratch():
            runs = self.run(with_policy=True)
        for step, r in enumerate(runs):
            expected = (step + 1) * self.micro_batches * self.seq_len
            assert r["tokens"] and all(n == expected for n in r["tokens"]), (
                f"{self.name}: after step {step + 1} the probe layers' forwards saw {r['tokens']} tokens, expected "
                f"{expected} each (every token once per micro-batch; re-runs for recomputation do not count)"
            )

    def _check_released(self, scratch: str, fds: set[str], tensor_bytes: int | None, when: str) -> None:
        assert not _hooks_installed(), f"{self.name}: saved-tensor hooks are still installed {when}"
        left = sorted(os.listdir(scratch))
        assert not left, f"{self.name}: files left in the scratch directory {when}: {left}"
        opened = sorted(_open_fds() - fds)
        assert not opened, f"{self.name}: file descriptors left open {when}: {opened}"
        if tensor_bytes is None:
            return
        now = _tensor_bytes()
        assert now <= tensor_bytes, f"{self.name}: {now - tensor_bytes} more bytes of tensors reachable {when}"

    def test_releases_everything_each_step(self) -> None:
        with _scratch() as scratch:
            model, policy = self.build(with_policy=True)
            self.train_step(model, policy, 0)  # the first step makes what every step keeps (gradients)
            fds, tensor_bytes = _open_fds(), _tensor_bytes()
            for step in range(1, 3):
                self.train_step(model, policy, step)
                self._check_released(scratch, fds, tensor_bytes, f"after step {step + 1}")

    def test_releases_everything_on_error(self) -> None:
        with _scratch() as scratch:
            # the last layer's probe fails in the second step's second micro-batch, after the first
            # micro-batch's backward and the earlier layers' forward
            fail_after = (self.micro_batches + 1) * self.seq_len
            model, policy = self.build(with_policy=True, probe={"fail_after_tokens": fail_after})
            probes = [m for m in model.modules() if isinstance(m, MemoryProbe)]
            for probe in probes[:-1]:
                probe.fail_after = None
            self.train_step(model, policy, 0)
            fds, tensor_bytes = _open_fds(), _tensor_bytes()
            message = None
            try:
                self.train_step(model, policy, 1)
            except RuntimeError as exc:  # not pytest.raises: its record would keep the failed forward alive
                message = str(exc)
            assert message is not None and "planned failure" in message, f"{self.name}: the planned failure did not propagate: {message!r}"
            self._check_released(scratch, fds, tensor_bytes, "after a step that raised half-way")

    def runs_under_context_parallel(self) -> bool:
        """What the launch reads: the declaration, and whether this config tiles sequences."""
        if self.factory is not None:
            return "context_parallel" in (self.capabilities or ())
        provided = self.suite_plugins().get("memory_policy", self.name)
        config = provided.spec.config(**self.config)
        return policy_runs_under(provided.spec, policy_effect(provided.spec, config), cp=2)

    @pytest.mark.slow  # gloo processes: outside the fast lane (megaseq_testkit/pytest_plugin.py)
    def test_context_parallel(self) -> None:
        from megaseq_testkit.distributed import run_gloo

        if not self.runs_under_context_parallel():
            _, raised = run_gloo(2, _cp_worker, self.settings(), True)[0]
            assert raised is not None, f"{self.name} does not run under context parallelism (its declaration) but did not raise under ctx.cp"
            assert "\n" not in raised.strip(), f"{self.name}: the error under context parallelism is not one line: {raised!r}"
            return
        for world in self.cp_world_sizes:
            results = run_gloo(world, _cp_worker, self.settings(), False)
            for rank, (pair, _) in enumerate(results):
                got, ref = pair
                self.compare([got], [ref], where=f", cp{world} rank {rank}")


def _summary(effect: MemoryEffect) -> str:
    """The fields of ``effect`` that change what the layers keep, as ``MemoryEffect(recompute='block', ...)``."""
    fields = ("recompute", "layers", "tile_tokens", "reuses_kept", "offload_min_bytes")
    default = MemoryEffect()
    shown = ", ".join(f"{f}={getattr(effect, f)!r}" for f in fields if getattr(effect, f) != getattr(default, f))
    return f"MemoryEffect({shown})"


def _cp_step(suite: MemoryPolicyConformance, with_policy: bool, rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    model, policy = suite.build(with_policy)
    torch.manual_seed(1)
    length = suite.cp_seq_len
    tokens = _batch(7, 0, length, model.dims.vocab_size)
    cp = ContextParallel(group=dist.group.WORLD, rank=rank, world_size=world, seq_len=length)
    bounds = torch.tensor([0, 3, length // 2 + 1, length], dtype=torch.int32)
    with policy.step() if policy is not None else contextlib.nullcontext():
        ctx = ForwardContext(cu_seqlens=bounds, cp=cp)
        hidden = model(zigzag_shard(tokens[:, :-1], rank, world), ctx)
        losses = chunked_token_losses(hidden, model.head_weight, zigzag_shard(tokens[:, 1:], rank, world), 32)
        loss = losses.sum() / length
        (loss + sum(ctx.losses.values(), torch.zeros(()))).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss.detach()[None], "aux": {k: v.detach() for k, v in ctx.losses.items()},
            "metrics": dict(ctx.metrics), "grads": grads}


def _cp_worker(rank: int, world: int, settings: dict[str, Any], expect_error: bool) -> tuple[Any, str | None]:
    suite = type("RankSuite", (MemoryPolicyConformance,), dict(settings))()
    with _scratch():
        if expect_error:
            try:
                _cp_step(suite, True, rank, world)
            except Exception as exc:  # the policy's own one-line error
                return None, str(exc)
            return None, None
        return (_cp_step(suite, True, rank, world), _cp_step(suite, False, rank, world)), None
