"""Where a training step's time goes: forward and backward of every component of a recipe, timed alone, with FLOPs.

One real training window is run through the model once to capture every component's input; then each
component (embedding, each block's norms, attention and FFN/MoE, the final norm, the LM head and loss) is run
again on its captured input, forward with autograd on, then backward from a fixed random output gradient
(auxiliary losses included). Fetching the batch (with the data transforms), the optimizer step and a whole
train step are timed too, so the sum of the parts can be checked against the whole. Times are CPU seconds of
this process (``process_time``, all threads together): with one intra-op thread they depend little on what
else the machine runs. Best of ``--repeat`` runs.

Sub-parts, indented under their component: the DSA layer splits into indexer projections (the lightning
indexer's linear layers), selection (``_select``: index scores and top-k, no gradient), sparse attention,
indexer KL loss (``kl_and_grads``, which the fused sparse pass calls per query chunk; the KL's target, the
head-mean of the attention's own probabilities, stays in sparse attention's row) and the rest (the main
query and latent projections and norms, the output projection). The chunked MoE splits into router
(affinities, top-k, combine weights), experts (the grouped SwiGLU products), shared expert and the rest
(dispatch plan, row gather, the combine's index_add, the balance loss).

How time is attributed: a sub-part is a callable replaced, on the object or module that holds it, by a
wrapper; plugin code is untouched. Forward: a sub-part gets the CPU time inside its calls, less that of
sub-parts nested in them. Backward: the autograd nodes a call creates (reached from its outputs, numbered
after the call began) get pre- and post-hooks, so each node's backward goes to the sub-part whose call
created it; the MoE recomputes each chunk inside its backward, calling the same wrappers, whose nodes are
hooked the same way. What no sub-part claims (the autograd engine itself, gradient accumulation into the
parameters, the MoE's custom backward around its recomputation, unwrapped ops) goes to the rest row. So the
backward split is exact per node and approximate as a whole.

FLOPs: one more forward and backward per component, counted by ``torch.utils.flop_counter.FlopCounterMode``'s
formulas (forward and backward separately, plus one for ``_grouped_mm``, which it lacks) through a dispatch mode
of this file that charges them to the sub-part running and records each matmul's shape: FlopCounterMode itself
cannot run over the MoE (its module tracker fails inside the MoE's autograd function). The formulas count
matmul-type ops only (mm, bmm, addmm, baddbmm, grouped mm, convolution, attention): norms, softmax, gathers,
top-k, elementwise ops and the optimizer count 0, so GFLOP/s is the matmul work over all of a row's CPU time.
GFLOP/s = FLOPs / CPU seconds.

Matmul reference: for each row, the forward matmul shape with the most FLOPs (its share of the row's forward
FLOPs beside it; a grouped mm as a batched matmul of equal groups), timed alone with ``torch.matmul``, fp32,
contiguous, at this process's thread count, in the same run; and the rate at 2048^3.

Memory: "saved" is what autograd keeps from the component's forward until its backward, per token (distinct
storages reached through saved-tensor hooks, its input included when it is saved, parameters not), beside
the component's own ``MemoryEstimate.saved_per_token`` where its record provides one.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/profile_step.py --seq-len 8192
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/profile_step.py --seq-len 65536 --repeat 1
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

REPO = Path(__file__).resolve().parents[1]
aten = torch.ops.aten

# A matmul as (batch, m, k, n): batch products of [m, k] by [k, n].
Dims = tuple[int, int, int, int]


# --- FLOPs and matmul shapes ------------------------------------------------------------------------------


def grouped_mm_flops(a_shape: Any, b_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """FLOPs of ``aten._grouped_mm`` (shapes in, as FlopCounterMode's formulas take them)."""
    if len(a_shape) == 2 and len(b_shape) == 2:  # the groups split the contraction (a weight's gradient)
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2 * math.prod(out_shape) * a_shape[-1]


# FlopCounterMode's formulas. Not the mode itself: its module tracker fails inside the MoE's autograd function
# (a hooked module's input needs a gradient but has no graph there), so OpCounter applies them.
FLOP_FORMULAS = FlopCounterMode(display=False, custom_mapping={aten._grouped_mm: grouped_mm_flops}).flop_registry


def matmul_dims(func: Any, args: tuple[Any, ...]) -> Dims | None:
    """(batch, m, k, n) of a matmul op; None for any other op. A grouped mm is taken as equal groups."""
    packet = func._overloadpacket
    shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
    if packet in (aten.addmm, aten.baddbmm):  # (bias, a, b): the product is a by b
        packet, shapes = (aten.mm if packet is aten.addmm else aten.bmm), shapes[1:]
    if packet is aten.mm:
        (m, k), (_, n) = shapes[:2]
        return 1, m, k, n
    if packet is aten.bmm:
        (batch, m, k), (_, _, n) = shapes[:2]
        return batch, m, k, n
    if packet is aten._grouped_mm:
        a, b = shapes[:2]
        groups = shapes[2][0] if len(shapes) > 2 else a[0]  # the offsets' length, else the stacked dimension
        if len(a) == 2 and len(b) == 3:
            return groups, a[0] // groups, a[1], b[2]
        if len(a) == 2 and len(b) == 2:
            return groups, a[0], a[1] // groups, b[1]
        if len(a) == 3 and len(b) == 3:
            return a[0], a[1], a[2], b[2]
        return groups, a[1], a[2], b[1] // groups
    return None


def format_dims(dims: Dims) -> str:
    batch, m, k, n = dims
    return f"{m}x{k}x{n}" if batch == 1 else f"{batch}x({m}x{k}x{n})"


def matmul_rate(dims: Dims, seconds: float = 0.2) -> float:
    """GFLOP per CPU second of ``torch.matmul`` alone at ``dims`` (fp32, contiguous, this process's threads): the
    best of three loops of about ``seconds / 3`` each, after one warm-up product."""
    batch, m, k, n = dims
    lead = (batch,) if batch > 1 else ()
    a, b = torch.randn(*lead, m, k), torch.randn(*lead, k, n)
    torch.matmul(a, b)
    best = 0.0
    for _ in range(3):
        calls, start = 0, time.process_time()
        while (elapsed := time.process_time() - start) < seconds / 3 or calls == 0:
            torch.matmul(a, b)
            calls += 1
        best = max(best, 2 * batch * m * k * n * calls / max(elapsed, 1e-9))
    return best / 1e9


# --- attribution to sub-parts -----------------------------------------------------------------------------


class Attribution:
    """CPU seconds and FLOPs of one forward and backward, by phase and sub-part.

    A stack holds the sub-parts running (labelled calls in forward, hooked autograd nodes in backward); every
    moment goes to its top, the component's rest at the bottom. FLOPs, when counted, go the same way, and the
    forward's matmul FLOPs are also kept by shape."""

    def __init__(self, rest: str) -> None:
        self.stack = [rest]
        self.phase = "forward"
        self.seconds: Counter[tuple[str, str]] = Counter()
        self.flops: Counter[tuple[str, str]] = Counter()
        self.shapes: defaultdict[str, Counter[Dims]] = defaultdict(Counter)
        self.claimed: set[Any] = set()  # autograd nodes already hooked for a sub-part
        self._since = time.process_time()

    def begin(self, phase: str) -> None:
        self.phase, self._since = phase, time.process_time()

    def end(self) -> None:
        self._charge()

    def push(self, label: str) -> None:
        self._charge()
        self.stack.append(label)

    def pop(self) -> None:
        self._charge()
        self.stack.pop()

    def _charge(self) -> None:
        clock = time.process_time()
        self.seconds[self.phase, self.stack[-1]] += clock - self._since
        self._since = clock

    def count(self, flops: int, dims: Dims | None) -> None:
        self.flops[self.phase, self.stack[-1]] += flops
        if dims is not None and self.phase == "forward":
            self.shapes[self.stack[-1]][dims] += flops


class OpCounter(TorchDispatchMode):
    """Charges every op's FLOPs (by ``formulas``, FlopCounterMode's) to the sub-part running, with its matmul shape."""

    def __init__(self, attribution: Attribution, formulas: dict[Any, Callable[..., int]]) -> None:
        super().__init__()
        self.attribution, self.formulas = attribution, formulas

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = self.formulas.get(func._overloadpacket)
        if formula is not None:
            self.attribution.count(formula(*args, **kwargs, out_val=out), matmul_dims(func, args))
        return out


_PROBE = torch.zeros((), requires_grad=True)


def next_node_number() -> int:
    """The number the next autograd node made on this thread gets: autograd numbers nodes in creation order."""
    with torch.enable_grad():
        return _PROBE.view(()).grad_fn._sequence_nr() + 1


class SubParts:
    """Labelled sub-parts of one component: callables replaced, on the object or module holding them, by wrappers
    that charge their calls, and the backward of the autograd nodes those calls create, to a label."""

    def __init__(self, rest: str) -> None:
        self.rest = rest  # the label of what no sub-part claims
        self.labels: list[str] = []
        self.attribution = Attribution(rest)
        self._undo: list[Callable[[], None]] = []

    def label(self, owner: Any, name: str, label: str) -> None:
        self.replace(owner, name, self.labelled(label, getattr(owner, name)))

    def replace(self, owner: Any, name: str, value: Any) -> None:
        if name in vars(owner):  # a module's global or an instance's own attribute: put it back
            original = vars(owner)[name]
            self._undo.append(lambda: setattr(owner, name, original))
        else:  # a method of the class: the instance attribute shadowing it goes
            self._undo.append(lambda: delattr(owner, name))
        setattr(owner, name, value)

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()

    def labelled(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        if label not in self.labels:
            self.labels.append(label)

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            first = next_node_number()
            self.attribution.push(label)
            try:
                out = fn(*args, **kwargs)
            finally:
                self.attribution.pop()
            self._claim(out, first, label)
            return out

        return call

    def _claim(self, outputs: Any, first: int, label: str) -> None:
        """Hook the autograd nodes numbered from ``first`` reached from ``outputs`` (those the call made) so that
        their backward goes to ``label``; a nested labelled call has claimed its own already."""
        todo = [t.grad_fn for t in tree_leaves(outputs) if isinstance(t, torch.Tensor)]
        seen: set[Any] = set()
        while todo:
            node = todo.pop()
            # gradient accumulators are numbered past every node: they belong to the parameters, not the call
            if node is None or node in seen or type(node).__name__ == "AccumulateGrad" or node._sequence_nr() < first:
                continue
            seen.add(node)
            todo += [n for n, _ in node.next_functions]
            if node not in self.attribution.claimed:
                self.attribution.claimed.add(node)
                node.register_prehook(lambda grads, label=label: self.attribution.push(label))
                node.register_hook(lambda grad_inputs, grad_outputs: self.attribution.pop())


def dsa_parts(parts: SubParts, layer: torch.nn.Module) -> None:
    """The DSA layer's sub-parts: indexer projections, selection, sparse attention, indexer KL loss. Under the
    ``native`` backend the indexer loss runs inside the kernels' attention pass (no row of its own), and the
    kernels' arithmetic is not made of torch operators, which the FLOP count sees (no FLOPs there)."""
    import megaseq_dsa.layer as dsa_layer
    import megaseq_dsa.ops.sparse as dsa_sparse

    parts.label(layer.indexer, "forward", "indexer projections")
    parts.label(layer, "_select", "selection")
    load = dsa_layer.BACKENDS.load

    def load_labelled(*args: Any, **kwargs: Any) -> Any:
        # the layer fetches its operations on every call: hand it labelled copies of the attention ones
        ops = load(*args, **kwargs)
        fused = ops.sparse_attention_with_indexer_kl
        return dataclasses.replace(
            ops,
            sparse_attention=parts.labelled("sparse attention", ops.sparse_attention),
            sparse_attention_with_indexer_kl=fused and parts.labelled("sparse attention", fused),
        )

    parts.replace(dsa_layer.BACKENDS, "load", load_labelled)
    parts.label(dsa_sparse, "kl_and_grads", "indexer KL loss")  # inside the fused pass
    parts.label(dsa_layer, "indexer_kl", "indexer KL loss")  # its own pass, where the backend has no fused one


def moe_parts(parts: SubParts, layer: torch.nn.Module) -> None:
    """The chunked MoE's sub-parts: router, routed experts, shared expert (dispatch and combine are the rest)."""
    parts.label(layer, "_select", "router")  # the first pass's choice of experts, chunk by chunk
    for name in ("affinities", "select", "combine_weights"):
        parts.label(layer.router, name, "router")
    parts.label(layer.experts, "forward", "experts")
    if layer.shared is not None:
        parts.label(layer.shared, "forward", "shared expert")


# the components split into sub-parts, by record: (label of the rest, the function labelling the sub-parts)
SPLITS: dict[tuple[str, str], tuple[str, Callable[[SubParts, torch.nn.Module], None]]] = {
    ("attention", "dsa"): ("main projections, rest", dsa_parts),
    ("moe", "chunked"): ("dispatch, combine, rest", moe_parts),
}


@contextmanager
def sub_parts(module: torch.nn.Module, record: tuple[str, str] | None) -> Iterator[SubParts]:
    """The component's sub-parts labelled while inside (none for a component without a split)."""
    rest, split = SPLITS.get(record, ("rest", None)) if record else ("rest", None)
    parts = SubParts(rest)
    try:
        if split is not None:
            split(parts, module)
        yield parts
    finally:
        parts.restore()


# --- measuring ----------------------------------------------------------------------------------------------


def cpu_seconds(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


@contextmanager
def phase(attribution: Attribution, name: str, counting: bool) -> Iterator[None]:
    """Charge what runs inside to phase ``name``; when counting, its FLOPs too, by sub-part and matmul shape."""
    with OpCounter(attribution, FLOP_FORMULAS) if counting else nullcontext():
        attribution.begin(name)
        yield
        attribution.end()


@dataclass
class Row:
    label: str
    forward_s: float
    backward_s: float
    forward_flops: int | None = None  # None: not counted
    backward_flops: int | None = None
    shapes: Counter[Dims] = field(default_factory=Counter)  # forward matmul FLOPs by shape
    saved: float | None = None  # bytes per token
    estimate: float | None = None
    phases: bool = True  # false: one time, not a forward and a backward (the data, the optimizer)

    @property
    def main_shape(self) -> Dims | None:
        return max(self.shapes, key=self.shapes.__getitem__) if self.shapes else None


def measure(
    label: str, run: Callable[[Any], torch.Tensor], parts: SubParts, autocast: Any, repeat: int,
    exclude: tuple[torch.Tensor, ...], seq_len: int,
) -> list[Row]:
    """The component's row and its sub-parts' rows: FLOPs and shapes from one counting pass, bytes saved for
    backward from one forward, CPU seconds from the best of ``repeat`` passes."""
    from megaseq.contracts import ForwardContext
    from megaseq_testkit.checks import saved_bytes

    grad: torch.Tensor | None = None

    def forward() -> tuple[torch.Tensor, Any]:
        ctx = ForwardContext()
        with autocast:
            return run(ctx), ctx

    def one_pass(counting: bool) -> Attribution:
        nonlocal grad
        attribution = parts.attribution = Attribution(parts.rest)
        with phase(attribution, "forward", counting):
            out, ctx = forward()
        if grad is None:
            grad = torch.randn(out.shape).to(out.dtype)
        outputs = [out, *ctx.losses.values()]
        grads = [grad, *(torch.ones_like(v) for v in ctx.losses.values())]
        with phase(attribution, "backward", counting):
            if any(o.requires_grad for o in outputs):
                torch.autograd.backward(outputs, grads)
        attribution.claimed.clear()  # the graph's nodes can go
        return attribution

    counted = one_pass(counting=True)
    parts.attribution = Attribution(parts.rest)  # the saved-bytes forward's nodes are hooked there, then dropped
    saved = saved_bytes(forward, exclude=exclude)[0] / seq_len
    timed = min((one_pass(counting=False) for _ in range(repeat)), key=lambda a: sum(a.seconds.values()))

    def seconds(phase: str, names: list[str]) -> float:
        return sum(timed.seconds[phase, name] for name in names)

    names = [*parts.labels, parts.rest]
    def flops(phase: str, names: list[str]) -> int:
        return sum(counted.flops[phase, name] for name in names)

    rows = [Row(
        label, seconds("forward", names), seconds("backward", names), flops("forward", names), flops("backward", names),
        sum(counted.shapes.values(), Counter()), saved,
    )]
    if parts.labels:
        rows += [Row(
            f"  {name}", seconds("forward", [name]), seconds("backward", [name]), flops("forward", [name]),
            flops("backward", [name]), counted.shapes[name],
        ) for name in names]
    return rows


def component_call(module: torch.nn.Module, x: torch.Tensor, with_ctx: bool) -> Callable[[Any], torch.Tensor]:
    """``module`` on its captured input ``x``, given the forward context when it takes one."""
    return (lambda ctx: module(x, ctx)) if with_ctx else (lambda ctx: module(x))


def fetch_batch(trainer: Any) -> Any:
    """One micro-batch as a train step builds it: the sampled windows, the length schedule's cut, the data
    transforms, the model's vocabulary, on the device."""
    from megaseq.data.transforms import apply_transforms
    from megaseq.eval.evaluate import batch_to

    recipe = trainer.recipe
    whole = trainer.train_windows.batch(trainer.sampler.next_indices()).cut(
        recipe.data.length_at(trainer.step, trainer.tokens))
    whole = apply_transforms(trainer.transforms, whole, recipe.run.seed, trainer.step + 1, 0)
    return batch_to(whole.to_vocab(recipe.data.token_ids), trainer.device)


# --- the table ----------------------------------------------------------------------------------------------


def print_table(rows: list[Row], rates: dict[Dims, float], step_s: float, seq_len: int) -> None:
    components = [r for r in rows if not r.label.startswith(" ")]  # sub-part rows are indented
    total_s = sum(r.forward_s + r.backward_s for r in components)
    total_flops = sum((r.forward_flops or 0) + (r.backward_flops or 0) for r in components)

    def giga(flops: int | None) -> str:
        return f"{flops / 1e9:>7.3f}" if flops is not None else f"{'-':>7}"

    def rate(flops: int | None, seconds: float) -> str:
        return f"{flops / seconds / 1e9:>8.2f}" if flops and seconds > 0 else f"{'-':>8}"

    print(f"{'part':<27} {'fwd s':>7} {'bwd s':>7} {'total':>7} {'share':>6} {'fwd GF':>7} {'bwd GF':>7} "
          f"{'fwd GF/s':>8} {'bwd GF/s':>8}  {'main matmul (fwd share)':<26} {'mm GF/s':>7} {'saved B/tok':>11} "
          f"{'estimate':>8}")
    for r in rows:
        seconds = r.forward_s + r.backward_s
        phases = f"{r.forward_s:>7.4f} {r.backward_s:>7.4f}" if r.phases else f"{'':>7} {'':>7}"
        dims = r.main_shape
        shape = f"{format_dims(dims)} ({100 * r.shapes[dims] / r.forward_flops:.0f}%)" if dims else "-"
        reference = f"{rates[dims]:>7.1f}" if dims else f"{'-':>7}"
        saved = f"{r.saved:>11.0f}" if r.saved is not None else f"{'':>11}"
        estimate = f"{r.estimate:>8.0f}" if r.estimate is not None else f"{'-' if r.saved is not None else '':>8}"
        print(f"{r.label:<27} {phases} {seconds:>7.4f} {100 * seconds / total_s:>5.1f}% {giga(r.forward_flops)} "
              f"{giga(r.backward_flops)} {rate(r.forward_flops, r.forward_s)} {rate(r.backward_flops, r.backward_s)}"
              f"  {shape:<26} {reference} {saved} {estimate}")
    print(f"{'sum of the parts':<27} {'':>15} {total_s:>7.4f} {'':>6} {total_flops / 1e9:>15.3f} "
          f"{rate(total_flops, total_s):>17}  (forward and backward together)")
    print(f"{'one train step':<27} {'':>15} {step_s:>7.4f}   ({seq_len / step_s:.0f} tokens per CPU second)")
    print(f"torch.matmul at 2048x2048x2048, fp32: {rates[1, 2048, 2048, 2048]:.1f} GFLOP/s")


def main() -> None:
    from megaseq.config import load_recipe
    from megaseq.contracts import ForwardContext
    from megaseq.model import chunked_token_losses
    from megaseq.plugins import get_plugins
    from megaseq.train.trainer import Trainer

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default=str(REPO / "recipes" / "genome-cpu.toml"))
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--set", action="append", default=[], help="recipe override, as for megaseq train")
    args = p.parse_args()

    plugins = get_plugins()
    with tempfile.TemporaryDirectory() as out:
        sets = [f"data.seq_len={args.seq_len}", "train.batch_size=1", "train.grad_accum=1", f"run.out_dir='{out}'",
                *args.set]
        trainer = Trainer(load_recipe(args.recipe, plugins, sets), plugins, progress=False, tensorboard=False)
        recipe, model = trainer.recipe, trainer.model
        bf16 = recipe.train.bf16
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
        batch = fetch_batch(trainer)
        rows = [Row("data (one batch)", cpu_seconds(lambda: fetch_batch(trainer), args.repeat), 0.0, phases=False)]

        # (label, module, record kind and name for its memory estimate and sub-parts, called with the context?)
        parts: list[tuple[str, torch.nn.Module, tuple[str, str] | None, bool]] = [
            ("embed", model.embed, None, False)
        ]
        for i, block in enumerate(model.blocks):
            ffn_kind, ffn_name = recipe.model.ffn_of(i)
            parts += [
                (f"{i}.attn_norm", block.attn_norm, None, False),
                (f"{i}.{recipe.model.attention_of(i)}", block.attention, ("attention", recipe.model.attention_of(i)), True),
                (f"{i}.ffn_norm", block.ffn_norm, None, False),
                (f"{i}.{ffn_name}", block.ffn, (ffn_kind, ffn_name), True),
            ]
        parts.append(("final_norm", model.final_norm, None, False))
        # Capture every component's input from one forward.
        inputs: dict[str, torch.Tensor] = {}
        hooks = [
            module.register_forward_hook(lambda m, a, o, label=label: inputs.__setitem__(label, a[0].detach()))
            for label, module, _, _ in parts
        ]
        with torch.no_grad(), autocast:
            hidden = model(batch.inputs, ForwardContext())
        for h in hooks:
            h.remove()

        parameters = tuple(model.parameters())
        dims = model.dims
        for label, module, record, with_ctx in parts:
            x = inputs[label]
            if x.is_floating_point():
                x.requires_grad_(True)
            estimate = None
            if record is not None:
                estimator = plugins.get(*record).spec.load_memory()
                if estimator is not None:
                    config = recipe.component(*record)
                    estimate = estimator(config, dims, args.seq_len).saved_per_token
            with sub_parts(module, record) as split:
                component = measure(label, component_call(module, x, with_ctx), split, autocast, args.repeat, parameters, args.seq_len)
            component[0].estimate = estimate
            rows += component
        h = hidden.detach().requires_grad_(True)
        head = model.head_weight
        with sub_parts(model, None) as split:
            rows += measure("head and loss", lambda ctx: chunked_token_losses(h, head, batch.targets, recipe.train.loss_chunk),
                            split, autocast, args.repeat, parameters, args.seq_len)
        step_s = cpu_seconds(trainer.train_step, args.repeat)
        # The optimizer alone, on the gradients of one more backward.
        loss = sum(p.sum() for p in model.parameters() if p.requires_grad)
        loss.backward()
        rows.append(Row("optimizer step", cpu_seconds(trainer.optimizer.step, args.repeat), 0.0, phases=False))

    # The reference products, after the model's: each main shape alone, and a large square one.
    shapes = {r.main_shape for r in rows if r.main_shape is not None} | {(1, 2048, 2048, 2048)}
    rates = {s: matmul_rate(s) for s in sorted(shapes)}
    print(f"recipe: {args.recipe} {' '.join(args.set)}; seq_len {args.seq_len}; bf16 autocast {bf16}; "
          f"{torch.get_num_threads()} intra-op thread(s); CPU seconds, best of {args.repeat}")
    print("GF: GFLOP by FlopCounterMode's formulas (matmul-type ops only); GF/s: GFLOP per CPU second")
    print("main matmul: the forward's matmul shape with the most FLOPs, [batch x] m x k x n, and its share of the "
          "row's forward FLOPs; mm GF/s: torch.matmul alone at that shape, fp32, in this run")
    print_table(rows, rates, step_s, args.seq_len)


if __name__ == "__main__":
    main()
