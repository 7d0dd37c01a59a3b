"""The memory planner behind ``megaseq plan`` and ``train.memory_policy = "auto"``.

It predicts the peak memory of one training step on one device from the components' own formulas (the
``memory`` targets of their records, ``MemoryEstimate``) and the memory policies' effects (the ``memory``
targets of policy records, ``MemoryEffect``), for the policy sets the installed policies offer as presets,
and proposes the cheapest set that fits. Nothing here builds a model or touches a device.

The model of one step on one device (bytes; ``N`` = tokens of one micro-batch on this device, i.e. windows
per micro-batch per data-parallel rank times ``seq_len / cp``):

    device peak = runtime + weights + gradients + reduction buckets + optimizer state (unless in host memory)
                + sum over layers of what the layer keeps between forward and backward
                + the most any one layer re-creates while its backward runs (recomputation)
                + the gradient stream (GRAD_STREAM x N x d_model x 4, or x 2 in bf16) + the largest temporary buffer

What a layer keeps, per token (``a``, ``f``: the attention's and feed-forward's ``saved_per_token``, ``o``:
the block's two norms, ``x``: the block input, d_model x 4 bytes):

    no policy            a + f + o
    recompute ffn        a + o + x          (re-creates f N in backward)
    recompute attention  f + o + x          (re-creates a N)
    recompute block      x                  (re-creates (a + f + o) N)
    ... in tiles of t    x + carry          (re-creates a t, and f t for a dense feed-forward or f N for MoE,
                                             whose input h, x per token, is then kept as well)

A recomputed block's re-run re-creates both parts at once; its backward then runs the feed-forward's part
beside that part's temporary and frees ``f N`` before the attention's part runs beside its own, so the block's
working set is the larger of ``(a + f + o) N + ffn temporary`` and ``(a + o / 2) N + attention temporary``.

A recomputed component also keeps what it declares as ``MemoryEstimate.kept_per_token`` (what its re-run takes
back instead of computing again, ``ForwardContext.keep``: a sparse attention's selected indices), beside its part's input,
where the policy's re-runs take it back (``MemoryEffect.reuses_kept``).

Offloading moves what layers keep to host memory (CUDA: a pinned pool; CPU: a scratch file on disk, so it
leaves the process's resident memory); the layer being differentiated brings back its input (on CUDA the
layer below's as well, loaded ahead) and, while each part's backward runs, what that part saved (``a N``
beside the attention's temporary, ``f N`` beside the feed-forward's), so the parts that are not recomputed peak at their saved bytes plus their
temporary.

Tensor parallelism runs with sequence parallelism (``megaseq.contracts.TensorParallel``): between components
a rank holds ``N / tp`` tokens, so the residual stream (the block inputs ``x``, the norms, the gradient stream,
the final norm) is divided by ``tp``. The components' estimates are one rank's (``ModelDims.tp_size``,
``ep_size``, ``etp_size``: ``MemoryEstimate``). A part that declares ``tensor_parallel``
(``megaseq.records.CAPABILITIES``) runs in one of two ways, by its kind:

- an attention or a dense feed-forward is a split region: it gathers the whole sequence and runs its block of
  heads or hidden width over it, so its estimate is taken at full length ``N`` (what it keeps includes its
  gathered input). Its exchanges hold full-length, d_model-wide fp32 buffers: leaving, its output (in
  backward, its gathered input's gradient) before the reduce-scatter and, on a CPU rank, gloo's receive buffer
  of the same size (gloo has no reduce-scatter: ``megaseq.parallel.collectives``), elsewhere the ``1/tp``
  result; entering backward, the gradient gathered from every rank, which the part's first backward step
  consumes. They are live before and after the part's own steps, not beside its largest temporary, so the
  part's working set is the larger of the two;
- an MoE runs on the rank's ``N / tp`` tokens (router and shared expert whole), so its estimate is taken at
  that length.

The loss gathers the final hidden states back (``megaseq.model.chunked_token_losses``), so the head keeps them
at full length, and each rank computes the logits of its ``1/tp`` of the vocabulary.

Under ``train.bf16`` components' activations (reported in fp32 bytes) are halved; the residual stream (the
block inputs ``x``, the norms' inputs, the gradient stream) is fp32 unless ``model.residual_dtype = "bf16"``
(``megaseq.model``), which halves those bytes too.

The gradient reduction (``megaseq.distributed.gradients``, under a layout of several ranks): DDP's buckets hold
the gradients of the parameters it sums, for the whole run. In the backward that sums them each gradient is
copied into its bucket as it is produced and freed, so the buckets take the gradients' place; with
``train.grad_accum > 1`` the earlier micro-batches' gradients accumulate beside them, one more copy of the
parameters' bytes (``Estimate.reduction``). Every parameter is counted: where a group has one rank (``ep x etp``
or ``tp`` ranks making up every rank) its parameters have no bucket, and the count is an upper bound.

The optimizer (``megaseq.train.optimizer``): AdamW's two fp32 moments per parameter beside the parameters;
with ``train.optimizer_state = "host"`` on CUDA, 16 bytes per parameter in (pageable) host memory instead (the
moments, an fp32 master and a gradient buffer; on a CPU run the moments stay where they are, in the process);
``train.optimizer_shard`` (ZeRO-1) divides either by the ``dp x cp`` ranks that hold the same parameters.
Host memory is reported in two parts, the offloaded activations (the pinned pool on CUDA) and the host
optimizer state; ``--host-mem`` bounds their sum.

Ranking: the sets that fit are ranked by their extra step time, summed over their policies: a calibration
measured on the machine when given (``plan(time_costs=...)``), else each policy's figure for the device kind
(``MemoryEffect.time_costs``, with its source), else its single estimate.

Where this is wrong and by how much: ``benchmarks/plan_accuracy.py`` measures it (``docs/results.md``, "The
planner's accuracy").
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megaseq.capabilities import check_components, policy_runs_under
from megaseq.config import Recipe
from megaseq.distributed.layout import Layout, check_zigzag_length
from megaseq.errors import UserError
from megaseq.memory.machine import DISTRIBUTED_WORKER_BYTES, RAY_WORKER_BYTES, GiB, Machine, gib, in_ray_worker
from megaseq.plugins import Plugins
from megaseq.records import MemoryEffect, MemoryEstimate, ModelDims

# Host memory per parameter of train.optimizer_state = "host" on CUDA (megaseq.train.optimizer.HostAdamW): two
# fp32 moments, an fp32 master copy and an fp32 buffer the gradient is copied into.
HOST_OPTIMIZER_BYTES = 16
# Gradients with respect to hidden states alive at once during backward, in units of N x d_model values of the
# residual stream.
GRAD_STREAM = 3
# Per token outside the blocks, besides the final norm (its input, d_model values of the residual stream, and
# rstd, NORM_BYTES) and its fp32 output kept for the chunked loss (d_model floats): the inputs, targets, weights
# and per-token losses (8 + 8 + 4 + 4).
HEAD_BYTES = 24
# What each RMSNorm keeps per token: its input (d_model values of the residual stream) and rstd (NORM_BYTES);
# the normalised output is recomputed in backward (``megaseq.model.RMSNorm``).
NORM_BYTES = 4
# The C library's heap on a CPU run that neither trims it (``run.trim_heap``, ``megaseq.memory.heap``) nor maps
# large allocations (``MemoryEffect.maps_allocations_from``): freed chunks below glibc's mmap threshold stay
# resident until reused, and a step allocates and frees activation-sized buffers in changing sizes, so resident
# memory exceeds live memory by HEAP_RETAINED x the step's live activations, up to HEAP_RETAINED_MAX bytes
# (buffers above the threshold, 32 MiB at most, are mapped and leave when freed). Set from the default recipe's
# measured peaks at 4k-24k tokens on chr20 and the shipped excerpt (`megaseq train`, one step and an evaluation;
# the heap kept 0.22-0.49 GiB there: docs/results.md, "The planner's accuracy"), so that all lie within 15%;
# tests/test_plan_accuracy.py checks it on the excerpt.
HEAP_RETAINED = 1.0
HEAP_RETAINED_MAX = int(0.35 * 2**30)


@dataclass(frozen=True)
class PolicyChoice:
    """One memory policy of a candidate set: its name, its full config and what the planner models it as."""

    name: str
    config: dict[str, Any]
    effect: MemoryEffect

    defaults: dict[str, Any] = field(default_factory=dict, compare=False)

    def __str__(self) -> str:
        """The policy and the options that differ from its defaults (the planner's pool size omitted)."""
        options = ", ".join(f"{k}={v}" for k, v in self.config.items()
                            if k != "pool_bytes" and (k not in self.defaults or self.defaults[k] != v))
        return f"{self.name}({options})" if options else self.name


@dataclass
class Estimate:
    """The predicted memory of one step on one device under one policy set (bytes)."""

    policies: list[PolicyChoice]
    weights: int = 0
    gradients: int = 0
    reduction: int = 0  # the gradient reduction's buckets beside accumulating gradients (module docstring)
    optimizer: int = 0
    runtime: int = 0
    saved_by_kind: dict[str, int] = field(default_factory=dict)
    recompute_peak: int = 0  # what the layer at the peak re-creates and needs while its backward runs
    layers_peak: int = 0  # kept by the layers still alive at the peak, plus that layer's working set
    gradient_stream: int = 0
    temporary: int = 0
    heap: int = 0  # CPU: what the C library's heap keeps resident beyond live memory (HEAP_RETAINED, _MAX)
    host: int = 0  # offloaded activations (CUDA: the pinned pool)
    host_optimizer: int = 0  # optimizer state in host memory (train.optimizer_state = "host" on CUDA)
    disk: int = 0  # offloaded activations on CPU (a scratch file)
    offloaded: int = 0
    time_cost: float = 0.0
    idle: str = ""  # why a policy of the set would act on nothing (such a set never fits: it would stop the run)
    fits: bool = False

    @property
    def device_peak(self) -> int:
        return (
            self.runtime + self.weights + self.gradients + self.reduction + self.optimizer + self.layers_peak
            + self.saved_by_kind.get("embedding+head", 0) + self.gradient_stream + self.temporary + self.heap
        )

    @property
    def host_total(self) -> int:
        """Everything the step holds in host memory: offloaded activations and the host optimizer state."""
        return self.host + self.host_optimizer

    @property
    def label(self) -> str:
        return " + ".join(str(p) for p in self.policies) or "none"


@dataclass
class Plan:
    recipe_source: str
    seq_len: int
    tokens: int  # per device per micro-batch
    layout: Layout
    machine: Machine
    candidates: list[Estimate]
    chosen: Estimate | None
    given: bool  # the policy set was given (--memory-policy NAMES / none), not chosen

    def summary(self) -> str:
        if self.chosen is None:
            return f"nothing fits in {gib(self.machine.device_bytes)} per {self.machine.kind} device"
        c = self.chosen
        return f"{c.label}: predicted peak {gib(c.device_peak)} of {gib(self.machine.device_bytes)} ({self.machine.kind})"


# -- the model ---------------------------------------------------------------------------------------------


@dataclass
class _LayerCost:
    """One layer's components and their estimates, evaluated at any call length (tiles are shorter calls)."""

    kind: str  # "sdpa+swiglu", for the table
    attention: tuple[Any, Any]  # (estimate function, config)
    ffn: tuple[Any, Any]
    ffn_tiles: bool  # a dense feed-forward (it tiles with the attention); else an MoE
    attention_tiles: bool  # the attention declares sequence_tiling
    dims: ModelDims
    # the part declares tensor_parallel: under tp > 1 the attention (and a dense feed-forward) is a split region,
    # an MoE runs on the rank's sequence chunk (module docstring); ``check_components`` refuses tp > 1 otherwise
    attention_tp: bool = False
    ffn_tp: bool = False
    cache: dict[tuple[str, int], MemoryEstimate] = field(default_factory=dict)

    def at(self, part: str, length: int) -> MemoryEstimate:
        if (part, length) not in self.cache:
            fn, config = self.attention if part == "attention" else self.ffn
            self.cache[(part, length)] = fn(config, self.dims, length)
        return self.cache[(part, length)]


def _estimate_fn(plugins: Plugins, recipe: Recipe, kind: str, name: str) -> tuple[Any, Any]:
    provided = plugins.get(kind, name)
    fn = provided.spec.load_memory()
    where = f"{recipe.source}: {kind} {name!r} ({provided.plugin.label})"
    if fn is None:
        raise UserError(f"{where} reports no memory estimate (its record has no 'memory' target): the planner cannot model it")

    def refusing(config: Any, dims: ModelDims, length: int) -> MemoryEstimate:
        try:  # a component refuses sizes it cannot run with a ValueError, as its build does
            return fn(config, dims, length)
        except ValueError as exc:
            raise UserError(f"{where}: {exc}") from None

    return refusing, recipe.component(kind, name)


def _layer_costs(recipe: Recipe, plugins: Plugins, layout: Layout) -> list[_LayerCost]:
    m = recipe.model
    # rank 0 of the layout's groups: each estimate gives one rank's share (MemoryEstimate)
    dims = ModelDims(d_model=m.d_model, n_layers=m.n_layers, vocab_size=m.vocab_size, ep_size=layout.ep,
                     etp_size=layout.etp, tp_size=layout.tp)
    shared: dict[tuple[str, str], _LayerCost] = {}
    out = []
    for layer in range(m.n_layers):
        attention = m.attention_of(layer)
        ffn_kind, ffn_name = m.ffn_of(layer)
        key = (attention, ffn_name)
        if key not in shared:  # layers of the same kind share their estimates
            attention_caps = plugins.get("attention", attention).spec.capabilities
            shared[key] = _LayerCost(
                f"{attention}+{ffn_name}", _estimate_fn(plugins, recipe, "attention", attention),
                _estimate_fn(plugins, recipe, ffn_kind, ffn_name), ffn_kind == "ffn",
                "sequence_tiling" in attention_caps, dims, "tensor_parallel" in attention_caps,
                "tensor_parallel" in plugins.get(ffn_kind, ffn_name).spec.capabilities,
            )
        out.append(shared[key])
    return out


def _combine(effects: list[MemoryEffect], layer: int) -> tuple[str | None, int | None, bool]:
    """The recompute part, tile length and whether re-runs take back kept values, acting on ``layer`` (the
    broadest part wins)."""
    rank = {"ffn": 1, "attention": 2, "block": 3}
    part, tile, reuse = None, None, False
    for e in effects:
        if e.recompute and e.acts_on(layer) and (part is None or rank[e.recompute] > rank[part]):
            part, tile, reuse = e.recompute, e.tile_tokens, e.reuses_kept
    return part, tile, reuse


def estimate(
    recipe: Recipe, plugins: Plugins, policies: list[PolicyChoice], layout: Layout, machine: Machine, seq_len: int,
    costs: list[_LayerCost] | None = None, time_costs: Mapping[str, float] | None = None,
) -> Estimate:
    """Predicted memory of one training step of ``recipe`` at ``seq_len`` on one device under ``policies``
    (``time_costs``: see :func:`policy_time_cost`)."""
    m, t = recipe.model, recipe.train
    tokens = tokens_per_device(recipe, layout, seq_len)
    length = seq_len // layout.cp  # one sequence's tokens on this device: what a component's call sees
    costs = costs if costs is not None else _layer_costs(recipe, plugins, layout)
    effects = [p.effect for p in policies]
    offload_min = min((e.offload_min_bytes for e in effects if e.offload_min_bytes is not None), default=None)
    act = 0.5 if t.bf16 else 1.0  # components report fp32 bytes; autocast keeps most activations in bf16
    residual = (2 if m.residual_dtype == "bf16" else 4) * m.d_model  # one token of the residual stream
    tp = layout.tp
    # per token of the micro-batch: sequence parallelism leaves each rank 1/tp of the residual stream
    x = residual / tp  # a block input
    norms = 2 * (residual + NORM_BYTES) / tp
    rows = tokens // length  # sequences per micro-batch on this device
    # a split region's exchange buffers (module docstring): fp32, full length
    region = 4 * m.d_model * tokens * (2 if machine.kind == "cpu" else 1 + 1 / tp) if tp > 1 else 0.0

    runtime = machine.runtime_bytes
    if machine.kind == "cpu":  # host memory is the device's: the data, and a worker's libraries
        runtime += training_data_bytes(recipe, plugins)
        if layout.world_size > 1:
            runtime += DISTRIBUTED_WORKER_BYTES + (RAY_WORKER_BYTES if in_ray_worker() else 0)
    cost = sum(policy_time_cost(p, machine.kind, time_costs) for p in policies)
    out = Estimate(policies, runtime=runtime, time_cost=cost)
    vocab = -(-m.vocab_size // tp)  # this rank's block of the vocabulary (megaseq.model.LanguageModel)
    params = vocab * m.d_model * 4 * (1 if m.tie_embeddings else 2) + 4 * m.d_model * (2 * m.n_layers + 1)
    for c in costs:
        params += c.at("attention", length).parameters + c.at("ffn", length).parameters
    out.weights, out.gradients = params, params
    out.reduction = params if layout.world_size > 1 and t.grad_accum > 1 else 0
    shards = layout.dp * layout.cp if t.optimizer_shard else 1  # ZeRO-1: each rank its share
    if t.optimizer_state == "host" and machine.kind == "cuda":
        out.host_optimizer = HOST_OPTIMIZER_BYTES * (params // 4) // shards
    else:
        out.optimizer = 2 * params // shards  # AdamW: two fp32 moments per (fp32) parameter

    offloaded, kept_so_far, backward_peak, largest_input = 0, 0.0, 0.0, 0
    for i, c in enumerate(costs):
        moe_chunk = tp if c.ffn_tp and not c.ffn_tiles else 1  # an MoE under tp routes the rank's 1/tp of the tokens
        attention, ffn = c.at("attention", length), c.at("ffn", length // moe_chunk)
        # bytes kept per token of the micro-batch
        a, f = act * attention.saved_per_token, act * ffn.saved_per_token / moe_chunk
        attention_temp = max(attention.temporary * rows, region if c.attention_tp else 0)
        ffn_temp = max(ffn.temporary * rows, region if c.ffn_tp and c.ffn_tiles else 0)
        temp = max(attention_temp, ffn_temp)
        part, tile, reuse = _combine(effects, i)
        # what a recomputed component keeps for its re-run (ForwardContext.keep), at its own dtype, per token of
        # its call (a split region's is gathered whole; an MoE under tp routes 1/tp of the tokens)
        rerun_a = attention.kept_per_token * tokens if reuse and part in ("block", "attention") else 0.0
        rerun_f = ffn.kept_per_token * tokens / moe_chunk if reuse and part in ("block", "ffn") else 0.0
        # what the layer keeps, in groups sized by the tensor the offload threshold is tested on (below)
        groups: list[tuple[float, float]] = []
        if part is None:
            kept, work, unit_input = (a + f + norms) * tokens, temp, 0.0
        elif part == "ffn":
            kept, work, unit_input = (a + norms + x) * tokens + rerun_f, f * tokens + temp, x * tokens
        elif part == "attention":
            kept, work, unit_input = (f + norms + x) * tokens + rerun_a, a * tokens + temp, x * tokens
        elif tile is None or not c.attention_tiles or tile >= length:
            # the block's re-run re-creates both parts' activations; backward then runs the FFN's part (beside its
            # temporary) and frees them before the attention's part runs beside its own
            work = max((a + f + norms) * tokens + ffn_temp, (a + norms / 2) * tokens + attention_temp)
            kept, unit_input = x * tokens + rerun_a + rerun_f, x * tokens
        else:
            if attention.tiling is None:
                raise UserError(f"{recipe.source}: attention of layer {i} ({c.kind}) declares sequence_tiling but its "
                                f"MemoryEstimate.tiling is None: the planner cannot size its tiles")
            n_tiles = math.ceil(length / tile)
            carry = attention.tiling.per_token * tokens + attention.tiling.per_tile * n_tiles * rows  # tp = 1: tiles refuse tp
            tile_attention = c.at("attention", tile)
            # a tile re-creates its attention's activations and concatenates the earlier tiles' carry
            tile_temp = tile_attention.temporary + attention.tiling.temporary
            work = (a + norms / 2) * tile * rows + tile_temp * rows + carry
            kept = x * tokens + carry + rerun_a + (rerun_f if c.ffn_tiles else 0.0)
            groups = [(kept, x * min(tile, length) * rows)]  # each tile's input slice, its carry and kept values
            if c.ffn_tiles:
                work += (f + norms / 2) * tile * rows + c.at("ffn", tile).temporary * rows
                unit_input = x * tile * rows
            else:  # an MoE layer runs whole after the attention tiles: its input h is kept too
                kept += x * tokens + rerun_f
                groups.append((x * tokens + rerun_f, x * tokens))
                work = max(work, (f + norms / 2) * tokens + ffn.temporary * rows)
                unit_input = x * tokens
        # The offload hooks test each saved tensor against the threshold, not a layer's sum. Each group of what
        # a layer keeps holds an input of x bytes per token (the block's or a part's, whole or a tile's slice):
        # a group whose input is below the threshold is counted as staying, otherwise as leaving whole (its
        # tensors narrower than d_model, a norm's rstd or a gate, counted as leaving too).
        groups = groups or [(kept, x * tokens)]  # one input tensor of the whole micro-batch
        largest_input = max(largest_input, *(size for _, size in groups))
        moved = sum(nbytes for nbytes, size in groups if offload_min is not None and size >= offload_min)
        if moved:
            offloaded += int(moved)
            kept -= moved
            # Backward brings back what each part saved while that part's backward runs, beside its temporary
            # (measured at 64k: a linear attention's part peaks at its saved bytes + its temporary). Recomputed parts bring
            # back only their input. On CUDA the pool loads ahead: bringing one tensor back starts loading the
            # one packed before it (the layer below's input, as large as this one's), so it is there as well.
            work += unit_input
            if machine.kind == "cuda":
                work += max(size for _, size in groups if size >= offload_min)
            if part is None:
                work = max((a + norms / 2) * tokens + attention_temp, (f + norms / 2) * tokens + ffn_temp)
            elif part == "ffn":
                work = max(work, (a + norms / 2) * tokens + attention_temp)
            elif part == "attention":
                work = max(work, (f + norms / 2) * tokens + ffn_temp)
        out.saved_by_kind[c.kind] = out.saved_by_kind.get(c.kind, 0) + int(kept)
        kept_so_far += kept
        # backward reaches layer i while layers 0..i still keep theirs: its working set comes on top
        if kept_so_far + work > backward_peak:
            backward_peak, out.recompute_peak = kept_so_far + work, int(work)
    out.offloaded = offloaded
    if offload_min is not None and not offloaded:
        out.idle = (f"moves nothing: every layer's block input (at most {_mib(largest_input)}) is below "
                    f"the threshold of the policy that offloads ({_mib(offload_min)})")
    if machine.kind == "cpu":
        out.disk = offloaded
    else:
        out.host += offloaded
    # the final norm (on the rank's share of the stream) and the whole sequence's hidden states the loss gathers
    head = ((residual + NORM_BYTES) / tp + 4 * m.d_model + HEAD_BYTES) * tokens
    out.saved_by_kind["embedding+head"] = int(head)
    out.gradient_stream = int(GRAD_STREAM * x * tokens)
    loss_chunk = min(t.loss_chunk, tokens)
    out.temporary = 3 * 4 * loss_chunk * vocab  # one chunk's logits, probabilities and their gradient
    # what the peak counts of the layers' keeping and working: the worst point of backward
    out.layers_peak = int(backward_peak)
    if machine.kind == "cpu" and not heap_trimmed(recipe, length) and not any(e.maps_allocations_from for e in effects):
        out.heap = min(int(HEAP_RETAINED * (out.layers_peak + head + out.gradient_stream + out.temporary)), HEAP_RETAINED_MAX)
    out.fits = (
        not out.idle
        and out.device_peak <= machine.device_bytes
        and (machine.host_bytes is None or out.host_total <= machine.host_bytes)
        and (machine.disk_bytes is None or out.disk <= machine.disk_bytes)
    )
    return out


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def policy_time_cost(choice: PolicyChoice, kind: str, time_costs: Mapping[str, float] | None = None) -> float:
    """The extra step time of one policy choice on a ``kind`` device: ``time_costs[str(choice)]`` when a
    calibration gives it (keys as the plan's table prints choices: ``"NAME"``, ``"NAME(part=ffn)"``),
    else the policy's figure for the device kind, else its single estimate."""
    if time_costs is not None and str(choice) in time_costs:
        return time_costs[str(choice)]
    return choice.effect.time_costs.get(kind, choice.effect.time_cost)


def heap_trimmed(recipe: Recipe, tokens: int) -> bool:
    """Whether a CPU run of ``recipe`` with ``tokens`` per sequence per device trims the heap at block
    boundaries (the rule of ``megaseq.memory.heap.apply_run_setting``)."""
    from megaseq.memory import heap

    trim = recipe.run.trim_heap
    return heap.available() and (trim is True or (trim == "auto" and tokens >= heap.TRIM_FROM_TOKENS))


def training_data_bytes(recipe: Recipe, plugins: Plugins) -> int:
    """The training token file's size (one byte per base), which a CPU run keeps resident: known for a data
    source that declares its bases, the FASTA file's size for a path (compressed files are undercounted)."""
    source = plugins.registry["data_source"].get(recipe.data.train)
    if source is not None:
        return getattr(source.spec, "bases", None) or 0  # a source that declares no size: unknown, not counted
    path = Path(recipe.data.train)
    return path.stat().st_size if path.is_file() else 0


def tokens_per_device(recipe: Recipe, layout: Layout, seq_len: int) -> int:
    windows = max(1, recipe.train.batch_size // layout.dp)
    return windows * (seq_len // layout.cp)


# -- policy sets -------------------------------------------------------------------------------------------


def _policy_choice(recipe: Recipe, plugins: Plugins, name: str, preset: dict[str, Any]) -> PolicyChoice:
    provided = plugins.get("memory_policy", name)
    effect_fn = provided.spec.load_memory()
    if effect_fn is None:
        raise UserError(f"memory_policy {name!r} ({provided.plugin.label}) reports no memory effect: the planner cannot model it")
    base = recipe.components.get("memory_policy", {}).get(name)
    values = {**(base.model_dump() if base is not None else {}), **preset}
    try:
        config = provided.spec.config(**values)
    except Exception as exc:  # a preset that its own schema rejects is the plugin's bug
        raise UserError(f"memory_policy {name!r}: preset {preset} is invalid: {exc}") from None
    defaults = {k: f.default for k, f in provided.spec.config.model_fields.items() if not f.is_required()}
    return PolicyChoice(name, config.model_dump(mode="json"), effect_fn(config), defaults)


def candidate_sets(recipe: Recipe, plugins: Plugins) -> list[list[PolicyChoice]]:
    """No policy, each installed policy's presets alone, and every pair of presets of different policies."""
    options: list[list[PolicyChoice]] = []
    for name in plugins.names("memory_policy"):
        spec = plugins.get("memory_policy", name).spec
        if spec.memory and spec.presets:
            options.append([_policy_choice(recipe, plugins, name, preset) for preset in spec.presets])
    sets: list[list[PolicyChoice]] = [[]]
    for group in options:
        sets += [[choice] for choice in group]
    for first, second in itertools.combinations(options, 2):
        sets += [[a, b] for a in first for b in second]
    return sets


def plan(
    recipe: Recipe,
    plugins: Plugins,
    *,
    seq_len: int | None = None,
    layout: Layout | None = None,
    machine: Machine,
    policies: str | list[str] = "auto",
    time_costs: Mapping[str, float] | None = None,
) -> Plan:
    """Plan ``recipe``: ``policies`` is ``"auto"`` (try every candidate set, propose the cheapest that fits),
    ``"none"`` or a list of policy names (configured by the recipe's sections). ``time_costs``: extra step
    time per policy choice measured on this machine, overriding the policies' own figures
    (:func:`policy_time_cost`)."""
    seq_len = recipe.data.seq_len if seq_len is None else seq_len
    layout = layout or Layout()
    if seq_len < 1:
        raise UserError(f"--seq-len {seq_len}: must be a positive number of tokens")
    check_zigzag_length(seq_len, layout.cp, "--seq-len")
    check_components(recipe, plugins, layout, policies if isinstance(policies, list) else [])
    if layout.ep > 1 and recipe.train.optimizer_shard:
        raise UserError(f"{recipe.source}: train.optimizer_shard cannot shard expert-parallel parameters (ep={layout.ep}: "
                        "each ep rank holds different experts); set train.optimizer_shard = false or ep = 1")
    if policies == "auto":
        # a set that cannot run under this layout is never a candidate
        sets = [s for s in candidate_sets(recipe, plugins)
                if all(policy_runs_under(plugins.get("memory_policy", p.name).spec, p.effect, layout.cp, layout.tp) for p in s)]
        given = False
    elif policies == "none":
        sets, given = [[]], True
    else:
        sets, given = [[_policy_choice(recipe, plugins, n, {}) for n in policies]], True
    costs = _layer_costs(recipe, plugins, layout)
    estimates = [estimate(recipe, plugins, s, layout, machine, seq_len, costs, time_costs) for s in sets]
    for e in estimates:
        _size_pools(e, recipe, plugins)
    fitting = [e for e in estimates if e.fits]
    chosen = None
    if given:
        chosen = estimates[0] if estimates[0].fits else None
    elif fitting:
        chosen = min(fitting, key=lambda e: (round(e.time_cost, 6), e.device_peak))
    return Plan(recipe.source, seq_len, tokens_per_device(recipe, layout, seq_len), layout, machine, estimates, chosen, given)


def stage_recipe(recipe: Recipe, length: int) -> Recipe:
    """The recipe as a window-length stage runs it: windows of ``length`` bases, as many more rows per micro-batch
    as the stage cuts each ``data.seq_len`` window into (the same tokens per step), no schedule."""
    rows = recipe.train.batch_size * (recipe.data.seq_len // length)
    data = recipe.data.model_copy(update={"seq_len": length, "schedule": []})
    return recipe.model_copy(update={"data": data, "train": recipe.train.model_copy(update={"batch_size": rows})})


def plan_stages(recipe: Recipe, plugins: Plugins, layout: Layout, machine: Machine,
                policies: str | list[str]) -> list[tuple[str, Estimate]]:
    """The peak of each stage of ``data.schedule`` under ``policies`` (a set's names, or "none"), shortest window
    first and ``data.seq_len`` last: what ``megaseq plan`` shows stage by stage."""
    from megaseq.distributed.layout import window_lengths

    found = []
    for key, length in window_lengths(recipe):
        result = plan(stage_recipe(recipe, length), plugins, layout=layout, machine=machine, policies=policies)
        found.append((f"{key} = {length}", result.candidates[0]))
    return found


def _size_pools(e: Estimate, recipe: Recipe, plugins: Plugins) -> None:
    """Give the policies that declare ``pool_sizing`` the bytes this plan moves (plus a margin) as their
    ``pool_bytes``, unless the recipe sets it."""
    for i, p in enumerate(e.policies):
        if "pool_sizing" in plugins.get("memory_policy", p.name).spec.capabilities and p.config["pool_bytes"] is None:
            sized = {**p.config, "pool_bytes": int(e.offloaded * 1.1) + 2**20}
            e.policies[i] = PolicyChoice(p.name, sized, p.effect, p.defaults)


def choose_memory_policy(recipe: Recipe, plugins: Plugins, device: Any) -> tuple[Recipe, Plan]:
    """For ``train.memory_policy = "auto"``: the recipe with the planner's proposed policies and configs."""
    result = plan(recipe, plugins, layout=Layout.of(recipe), machine=Machine.detect(device.type))
    if result.chosen is None:
        raise UserError(f"{recipe.source}: train.memory_policy = 'auto': {result.summary()} (see `megaseq plan {recipe.source}`)")
    chosen = result.chosen.policies
    configs = {p.name: plugins.get("memory_policy", p.name).spec.config(**p.config) for p in chosen}
    components = {**recipe.components, "memory_policy": configs}
    train = recipe.train.model_copy(update={"memory_policy": [p.name for p in chosen]})
    return recipe.model_copy(update={"train": train, "components": components}), result


@dataclass(frozen=True)
class RunPlan:
    """What a run knows of its memory before its first step: the recipe with the policies it runs (the planner's
    choice under ``train.memory_policy = "auto"``), the plan behind that choice, and the planned peak."""

    recipe: Recipe
    chosen_by: Plan | None  # the planner's comparison, where it chose the policies
    peak: Estimate | str  # the plan of the policies run, or why there is none

    @property
    def peak_gib(self) -> float | None:
        return self.peak.device_peak / GiB if isinstance(self.peak, Estimate) else None

    @property
    def maps_large_allocations(self) -> bool:
        """Whether a policy of the run serves large allocations by their own maps on CPU
        (``MemoryEffect.maps_allocations_from``); False where the run has no plan."""
        return isinstance(self.peak, Estimate) and any(p.effect.maps_allocations_from for p in self.peak.policies)

    @property
    def note(self) -> str:
        return f"{self.peak_gib:.2f}G per device" if self.peak_gib is not None else str(self.peak)


def plan_run(recipe: Recipe, plugins: Plugins, device: Any) -> RunPlan:
    """The trainer's memory stage: choose the policies where the recipe asks the planner to, and plan the peak."""
    if recipe.train.memory_policy == "auto":
        recipe, chosen_by = choose_memory_policy(recipe, plugins, device)
        return RunPlan(recipe, chosen_by, chosen_by.chosen)
    return RunPlan(recipe, None, planned_peak(recipe, plugins, device))


def planned_peak(recipe: Recipe, plugins: Plugins, device: Any) -> Estimate | str:
    """The plan of a run with the recipe's own policies on ``device`` (one device of its layout), or why there is
    none (a component or policy the planner cannot model), for the run header."""
    names = recipe.train.memory_policy
    try:
        result = plan(recipe, plugins, layout=Layout.of(recipe), machine=Machine.detect(device.type),
                      policies=list(names) or "none")
    except Exception as exc:  # the run goes on without a plan (its header says why): a formula's bug is no reason to stop
        return f"not planned: {exc}"
    return result.candidates[0]


__all__ = [
    "Estimate",
    "Plan",
    "PolicyChoice",
    "RunPlan",
    "candidate_sets",
    "choose_memory_policy",
    "estimate",
    "plan",
    "plan_run",
    "plan_stages",
    "planned_peak",
    "stage_recipe",
]
