"""The contracts between core and plugins: what a component receives and what it must do.

A component is an ``nn.Module`` built by its record's target, ``build(config, dims, layer_idx)``. Every
forward receives a :class:`ForwardContext` that carries what is shared by all layers of one forward pass:
document boundaries of packed rows, the context-parallel shard, routing record/replay, and places to put
auxiliary losses and metrics. The conformance suites in ``megaseq_testkit`` are the executable form of
these contracts.

Example: a minimal attention component (see docs/writing-a-plugin.md for the packaging around it)::

    class Identity(nn.Module):
        def forward(self, x, ctx, cache=None):
            return x                      # causal, packing-safe and decodable, trivially

        def init_cache(self, batch_size, *, device, dtype):
            return None
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import torch
from torch import Tensor

from megaseq.alphabets import DNA, Alphabet
from megaseq.documents import Documents
from megaseq.records import ModelDims

if TYPE_CHECKING:
    from megaseq.data.windows import Batch


@dataclass(frozen=True)
class ContextParallel:
    """This rank's share of a sequence split over a context-parallel process group.

    Layout (the only one): zig-zag. The global sequence of length ``seq_len`` (a multiple of
    ``2 * world_size``) is cut into ``2 * world_size`` equal segments; rank ``r`` holds segments ``r`` and
    ``2 * world_size - 1 - r``, concatenated in that order. Pairing an early and a late segment balances
    causal-attention work across ranks. ``megaseq.parallel.zigzag_shard`` does the split.
    """

    group: Any  # torch.distributed.ProcessGroup
    rank: int
    world_size: int
    seq_len: int

    def __post_init__(self) -> None:
        if self.seq_len % (2 * self.world_size):
            raise ValueError(
                f"context parallel: sequence length {self.seq_len} is not a multiple of 2 x {self.world_size} ranks"
            )

    @property
    def segment_len(self) -> int:
        return self.seq_len // (2 * self.world_size)

    def segments(self) -> list[tuple[int, int]]:
        """Global ``[start, end)`` of the local segments, in local order."""
        n = self.segment_len
        return [(i * n, (i + 1) * n) for i in (self.rank, 2 * self.world_size - 1 - self.rank)]

    def positions(self, device: torch.device | str | None = None) -> Tensor:
        """Global position of every local token, shape ``[seq_len // world_size]``."""
        return torch.cat([torch.arange(a, b, device=device) for a, b in self.segments()])


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in a tensor-parallel group, with sequence parallelism (megatron-core's layout).

    A component built with ``ModelDims(tp_rank=r, tp_size=n)`` holds ``1/n`` of its heads or hidden width
    (rank ``r`` the ``r``-th contiguous block of every split weight). Between components the activations are
    split along the sequence: a component receives and returns this rank's ``r``-th contiguous ``1/n`` of the
    tokens of the rank's window (or of its context-parallel shard). It gathers the sequence before its
    split region and reduce-scatters its partial output after it (``megaseq.parallel.tp_gather`` and
    ``tp_reduce_scatter``); ``cu_seqlens`` and ``cp`` describe the gathered sequence.

    ``sequence_parallel = False`` (decoding, ``megaseq.inference.cached``: a step of one token cannot be split
    along the sequence) is megatron's tensor parallelism without sequence parallelism: every rank holds the
    whole sequence between split regions, the gather before a region is the identity and the reduce-scatter
    after it an all-reduce. The mappings of ``megaseq.parallel`` read this field, so a component that uses
    them runs in both modes unchanged.
    """

    group: Any  # torch.distributed.ProcessGroup
    rank: int
    world_size: int
    sequence_parallel: bool = True


class RoutingReplay:
    """Records the expert choice of every MoE layer in one forward and replays it in another.

    RL needs the trainer's forward to route tokens as the rollout did (R3). MoE layers call
    :meth:`route` with a stable key (their module name) and the indices they computed; in ``"record"``
    mode the indices are stored and returned, in ``"replay"`` mode the stored indices are returned instead.
    """

    def __init__(self, mode: Literal["record", "replay"] = "record") -> None:
        if mode not in ("record", "replay"):
            raise ValueError(f"routing replay mode must be 'record' or 'replay', got {mode!r}")
        self.mode = mode
        self.indices: dict[str, Tensor] = {}

    def route(self, key: str, indices: Tensor) -> Tensor:
        if self.mode == "record":
            self.indices[key] = indices.detach().clone()
            return indices
        if key not in self.indices:
            raise KeyError(f"routing replay has no record for layer {key!r}; recorded: {sorted(self.indices)}")
        stored = self.indices[key]
        if stored.shape != indices.shape:
            raise ValueError(f"routing replay for {key!r}: recorded {tuple(stored.shape)}, now {tuple(indices.shape)}")
        return stored.to(indices.device)

    def replay(self) -> RoutingReplay:
        """A replaying copy of what was recorded."""
        out = RoutingReplay("replay")
        out.indices = dict(self.indices)
        return out


def recomputing() -> bool:
    """True while autograd's backward pass is running the calling code.

    A forward that runs then is a re-run for activation recomputation (a memory policy's,
    ``torch.utils.checkpoint`` reentrant or not, or any other wrapper that re-runs a forward in backward).
    Such a re-run must not repeat the first forward's side effects: :class:`ForwardContext` drops its losses
    and metrics by itself, and a component that updates its own state in forward (e.g. load counters)
    skips the update when ``ctx.recomputing`` is true.
    """
    return torch._C._current_graph_task_id() != -1  # -1 outside the autograd engine


class KeptValues:
    """What one recomputation unit's forward keeps for its re-run in backward (:meth:`ForwardContext.keep`).

    Recording (the forward): ``keep`` computes each value and appends it, with its name, in call order.
    Replaying (``KeptValues(items)``, the re-run): ``keep`` hands the same values out in the same order instead of
    computing them; a re-run that asks for another name, or more values, than its forward kept is not
    deterministic and fails. A recompute implementation makes one per unit, keeps ``items`` until the unit's
    backward (e.g. as saved tensors, so offloading policies see them) and drops them after it.
    """

    def __init__(self, items: list[tuple[str, Tensor]] | None = None) -> None:
        self.items: list[tuple[str, Tensor]] = [] if items is None else items
        self.replaying = items is not None
        self.used = 0

    def get(self, name: str, compute: Callable[[], Tensor]) -> Tensor:
        if not self.replaying:
            value = compute()
            if not isinstance(value, Tensor) or value.requires_grad:
                raise TypeError(f"ForwardContext.keep({name!r}): only a tensor without gradient can be kept for a "
                                f"re-run, got {type(value).__name__}{' that requires grad' if isinstance(value, Tensor) else ''}")
            self.items.append((name, value))
            return value
        if self.used >= len(self.items) or self.items[self.used][0] != name:
            kept = [n for n, _ in self.items]
            raise RuntimeError(f"ForwardContext.keep({name!r}): the re-run of a recomputed part asks for value "
                               f"{self.used} as {name!r}, its forward kept {kept}: a component's forward is not deterministic")
        self.used += 1
        return self.items[self.used - 1][1]

    @property
    def exhausted(self) -> bool:
        """Whether a re-run has taken every value its forward kept."""
        return self.used == len(self.items)


@dataclass
class ForwardContext:
    """Shared state of one forward pass, handed to every component.

    ``cu_seqlens``: int32 ``[N + 1]`` cumulative document lengths of a packed batch (then the batch size is 1).
    No attention, state or convolution may cross a boundary. ``None`` means each row is one document.
    Components read the layout through :attr:`documents` (built once per forward, the batch's only host
    synchronisation), not from ``cu_seqlens`` directly.
    ``cp``: the context-parallel shard when the sequence is split over ranks, else ``None``; with ``cp``,
    inputs are this rank's zig-zag share and ``cu_seqlens`` (if any) are global boundaries.
    ``routing``: MoE routing record/replay, or ``None``.
    ``ep_group``: the expert-parallel process group (experts sharded as ``ModelDims.ep_rank/ep_size``), or ``None``.
    ``tp``: the tensor-parallel group (:class:`TensorParallel`: inputs are this rank's sequence chunk, or the whole
    sequence without sequence parallelism), or ``None``.
    ``etp_group``: the expert-tensor-parallel group (each routed expert's hidden width split as
    ``ModelDims.etp_rank/etp_size``; its ranks hold the same experts), or ``None``.
    ``losses``: auxiliary losses (already weighted) that the trainer adds to the LM loss and logs by name.
    ``metrics``: scalars a component wants logged for this step (``log``), each a float or, for a tensor logged,
    a 0-dim float64 tensor on its device; ``metric_counts``: how many values each holds the mean of.

    Recomputation: while a forward is re-run during backward (see :func:`recomputing`), :meth:`add_loss`
    and :meth:`log` do nothing, because the first forward already recorded the same values and its losses
    already carry their gradients. So any recompute wrapper, written with ``torch.utils.checkpoint`` or by
    hand, counts auxiliary losses and metrics once. A wrapper that re-runs a forward and differentiates the
    re-run's losses itself passes :meth:`for_recomputation`'s context, which does record them.
    A component keeps what its re-run need not compute again with :meth:`keep`.
    """

    cu_seqlens: Tensor | None = None
    cp: ContextParallel | None = None
    routing: RoutingReplay | None = None
    ep_group: Any | None = None
    tp: TensorParallel | None = None
    etp_group: Any | None = None
    losses: dict[str, Tensor] = field(default_factory=dict)
    metrics: dict[str, float | Tensor] = field(default_factory=dict)
    metric_counts: dict[str, int] = field(default_factory=dict)
    _documents: Documents | None = field(default=None, init=False, repr=False, compare=False)
    _records_in_backward: bool = field(default=False, repr=False, compare=False)
    _kept: KeptValues | None = field(default=None, repr=False, compare=False)

    @property
    def documents(self) -> Documents | None:
        """The document layout of ``cu_seqlens`` (``megaseq.documents.Documents``), ``None`` without packing.

        Built and validated on first use, then shared by every layer of this forward; memoize layouts you
        derive from it with ``ctx.documents.derive(key, build)``."""
        if self.cu_seqlens is None:
            return None
        if self._documents is None:
            self._documents = Documents(self.cu_seqlens)
        return self._documents

    @property
    def recomputing(self) -> bool:
        """True while this forward is a re-run for activation recomputation (see :func:`recomputing`)."""
        return recomputing()

    def add_loss(self, name: str, value: Tensor) -> None:
        """Add an auxiliary loss; losses with the same name (e.g. one per layer) are summed.
        Ignored during recomputation (see the class docstring)."""
        if self.recomputing and not self._records_in_backward:
            return
        self.losses[name] = self.losses[name] + value if name in self.losses else value

    def log(self, name: str, value: float | Tensor) -> None:
        """Report a scalar metric, a mean over this forward's local tokens (e.g. per token of this rank's
        shard). Values reported under one name (e.g. once per layer) are averaged: ``metrics[name]`` is their
        mean. The trainer logs, per step, the mean over every value reported under the name, in every
        micro-batch and on every rank; use per-layer names to see layers apart. A tensor stays on its device (the
        trainer reads all of a step's values at once, so logging costs no host synchronisation). Ignored during
        recomputation (see the class docstring)."""
        if self.recomputing and not self._records_in_backward:
            return
        n = self.metric_counts.get(name, 0) + 1
        mean = self.metrics.get(name, 0.0)
        # a metric carries no gradient; float64, the precision of the host's float
        value = value.detach().to(torch.float64) if isinstance(value, Tensor) else float(value)
        self.metrics[name] = mean + (value - mean) / n
        self.metric_counts[name] = n

    def keep(self, name: str, compute: Callable[[], Tensor]) -> Tensor:
        """``compute()``, computed once per recomputation unit: a forward that a recompute implementation will
        re-run in backward keeps the value, and the re-run gets it back instead of computing it again.

        For values that are expensive, carry no gradient (an integer choice: a sparse attention's top-k key indices) and that
        the re-run would compute bitwise again from the same inputs, so keeping them changes no result. Kept
        values live from the unit's forward to the end of its backward, as saved tensors do (a memory policy
        that moves saved tensors moves them too); the component declares their size
        (``MemoryEstimate.kept_per_token``). Without a recompute implementation (no policy, ``torch.no_grad``,
        ``torch.utils.checkpoint``) this is ``compute()`` and nothing is kept. ``name`` labels the value in
        errors; values are handed back in call order.
        """
        return compute() if self._kept is None else self._kept.get(name, compute)

    def fork(self, kept: KeptValues | None = None) -> ForwardContext:
        """The same context (documents, context parallelism, routing, groups) with empty losses and metrics:
        for running part of a forward separately and merging its results with :meth:`merge`. ``kept``: where
        :meth:`keep` records or replays in the fork (a recompute implementation's, per unit); default this
        context's."""
        out = dataclasses.replace(self, losses={}, metrics={}, metric_counts={})
        out._documents = self._documents  # the layout is the same: built once per batch
        out._kept = self._kept if kept is None else kept
        return out

    def for_recomputation(self, kept: KeptValues | None = None) -> ForwardContext:
        """A :meth:`fork` that records losses and metrics also inside backward: the context a recompute
        implementation re-runs a forward with when it differentiates that re-run's losses itself (``kept``:
        what the forward kept, replaying)."""
        out = self.fork(kept)
        out._records_in_backward = True
        return out

    def merge(self, other: ForwardContext) -> None:
        """Add ``other``'s losses and metrics (from a :meth:`fork`) to this context, each metric with the
        number of values it is the mean of."""
        for name, value in other.losses.items():
            self.add_loss(name, value)
        for name, value in other.metrics.items():
            for _ in range(other.metric_counts.get(name, 1)):
                self.log(name, value)


@runtime_checkable
class Attention(Protocol):
    """A causal token mixer: ``[B, T, d_model] -> [B, T, d_model]``.

    - Causal: output at position t depends on inputs at positions <= t only.
    - Packing: with ``ctx.cu_seqlens`` nothing crosses a document boundary; the result equals running the
      documents separately.
    - Decoding: ``init_cache`` makes an empty per-sequence inference state; ``forward(x, ctx, cache)`` with a
      cache treats ``x`` as the continuation of the cached sequences (any length >= 1: a prefill, then
      one token at a time), updates the cache in place, and equals the full forward. Caches are used without
      packing and without context parallelism.
    - Context parallelism: with ``ctx.cp`` the output equals the single-rank output at the local positions,
      in values and gradients; a component that cannot do this raises a one-line error. Auxiliary losses
      (``ctx.add_loss``) are per-rank shares that add up to the single-rank loss, as gradients do.
    """

    def forward(self, x: Tensor, ctx: ForwardContext, cache: Any | None = None) -> Tensor: ...

    def init_cache(self, batch_size: int, *, device: torch.device, dtype: torch.dtype) -> Any: ...


@runtime_checkable
class FeedForward(Protocol):
    """A per-token block ``[B, T, d_model] -> [B, T, d_model]``: each token's output depends on that token only."""

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor: ...


# What every MoE's load_stats() reports; the trainer logs each as moe/load/KEY (megaseq.train.step)
LOAD_STAT_KEYS = (
    "tokens_per_expert_max",
    "tokens_per_expert_mean",
    "tokens_per_rank_max",
    "tokens_per_rank_mean",
    "routing_entropy",
)


@runtime_checkable
class MoE(FeedForward, Protocol):
    """A mixture-of-experts feed-forward block, dropless.

    ``forward`` must equal, for every token x, ``shared_forward(x) + sum_j w_j * expert_forward(e_j, x)`` with
    ``(e, w) = route(x)`` (or the replayed ``e`` when ``ctx.routing`` replays), however skewed the routing,
    whatever ``chunk_tokens`` is (an attribute that may be changed at run time; ``None`` = unchunked).
    ``load_stats`` describes the last training forward and returns at least
    :data:`LOAD_STAT_KEYS`: counts of (token, expert) assignments per expert and per
    expert-parallel rank (max, mean) and the routing entropy in nats (``log n_experts`` when even), each a
    float or a 0-dim tensor (left on the device: the trainer reads every layer's at once, once per step).
    """

    n_experts: int
    top_k: int
    chunk_tokens: int | None

    def route(self, x: Tensor, indices: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Expert indices ``[N, k]`` and combine weights ``[N, k]`` for tokens ``x [N, d]``; with ``indices``
        given, the weights of those experts instead of the router's choice."""
        ...

    def expert_forward(self, expert: int, x: Tensor) -> Tensor: ...

    def shared_forward(self, x: Tensor) -> Tensor: ...

    def load_stats(self) -> dict[str, float | Tensor]: ...


@runtime_checkable
class MemoryPolicy(Protocol):
    """Trades compute, host memory or disk for device memory: recomputation, offloading, sequence tiling.

    Built by its record's target as ``build(config)``; a recipe switches policies on with
    ``train.memory_policy = ["name", ...]`` (applied in that order) and configures each in
    ``[memory_policy.NAME]``. The trainer then calls:

    - ``apply(model)`` once, after the model is built and before the optimizer exists. Find the layers to act
      on with ``megaseq.memory.model_layers(model)`` (each with its index, its components' kinds and names,
      and the block, attention and feed-forward modules) and change how they run with
      ``Layer.wrap(part, wrapper)``, which keeps parameter names (checkpoints, ``train.trainable``) as they are.
      A policy that finds nothing to act on raises ``megaseq.errors.UserError`` (one line).
    - ``step()`` around the forwards and backwards of every optimizer step (all its micro-batches): a context
      manager that acquires what the step needs (saved-tensor hooks, a host-memory pool, a scratch file)
      and, when the block exits, normally or by an exception, releases all of it. What is slow to acquire
      every step (page-locked host memory) the policy object may keep and reuse from step to step; it is
      released when the policy is dropped, so a policy needs no global state and no lifecycle hook.

    Forwards outside ``step()`` (evaluation, generation) and forwards under ``torch.no_grad()`` (also inside a
    step: the RL loop's old log-probabilities) must work and give the outputs of the model without the
    policy; they save nothing for backward, so a policy usually lets them run as they are. Several forwards
    may run before one backward (each micro-batch's forward, then one backward of their sum): what a policy
    keeps for a forward must not be keyed so that a later forward of the same layer replaces it.

    Correct means invisible: with the policy, the loss, every gradient, the auxiliary losses and the metrics
    equal those without it (bitwise where the order of operations is unchanged), also under context
    parallelism. A lossy policy (one that rounds what it keeps, e.g. bf16 copies) states its bound: the
    relative error of the loss and of the whole gradient vector. Recomputation gets auxiliary losses and metrics right by construction: a forward re-run in
    backward does not record them again (``ForwardContext.recomputing``). ``megaseq_testkit.memory_policy.
    MemoryPolicyConformance`` is the executable form of this contract.
    """

    def apply(self, model: torch.nn.Module) -> None: ...

    def step(self) -> AbstractContextManager[None]: ...


@dataclass(frozen=True)
class Tile:
    """Tokens ``[start, stop)`` of a sequence of ``seq_len`` tokens run as one tile (see :class:`SequenceTiling`)."""

    start: int
    stop: int
    seq_len: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.stop <= self.seq_len:
            raise ValueError(f"tile [{self.start}, {self.stop}) is not a non-empty part of [0, {self.seq_len})")

    @property
    def length(self) -> int:
        return self.stop - self.start


@runtime_checkable
class SequenceTiling(Protocol):
    """Optional capability: run one sequence as consecutive tiles, carrying what later tiles need.

    An attention component opts in by implementing ``forward_tile``; memory policies then recompute a long
    sequence tile by tile, so nothing of full length is ever held inside a layer. Feed-forward components
    (kind ``ffn``) tile over tokens without opting in: their output is per token. MoE layers chunk tokens
    themselves (``MoE.chunk_tokens``) and are not tiled from outside.

    ``forward_tile(x, ctx, tile, history) -> (out, carry)``: ``x`` holds the tokens ``[tile.start,
    tile.stop)`` of every row, ``ctx`` describes the whole sequence (``cu_seqlens`` are global boundaries),
    ``history`` lists the ``carry`` tuples that the earlier tiles returned, in order (empty for the first
    tile). ``out`` must equal the full forward's output at those tokens, in values and in gradients, where
    gradients reach earlier tiles through ``history``: so ``carry`` is a tuple of tensors that stay connected
    to the autograd graph (a linear attention: its recurrent state and its convolution's last inputs; softmax and
    sparse attention: this tile's keys and values). Tile lengths are arbitrary (not multiples of any chunk) and
    documents cross tile boundaries. Auxiliary losses are this tile's share (shares add up to the full
    loss, as under context parallelism); metrics are per-token means over the tile (the caller combines
    tiles weighted by their lengths). Tiling is for training forwards: no cache, no context parallelism.
    ``megaseq_testkit.tiling.SequenceTilingConformance`` checks all of this.
    """

    def forward_tile(
        self, x: Tensor, ctx: ForwardContext, tile: Tile, history: list[tuple[Tensor, ...]]
    ) -> tuple[Tensor, tuple[Tensor, ...]]: ...


@runtime_checkable
class RLAlgorithm(Protocol):
    """A policy-gradient objective over groups of sampled completions (group-relative advantages, ...).

    Built by its record's target as ``build(config)``. An RL step draws ``G`` prompts, ``n`` completions each
    (``n >= min_group_size``, else the RL loop refuses to start), and calls, in this order:

    1. ``shape_rewards(rewards [G, n], lengths [G, n], max_new_tokens) -> [G, n]``: reward shaping that
       depends on completion length (e.g. a penalty on overlong completions); identity when the algorithm has none.
       Rewards are finite (the loop rejects NaN/inf before).
    2. ``filter(rewards [G, n], truncated [G, n] bool) -> (groups [G] bool, completions [G, n] bool)``:
       which groups to train on (False = drop and resample, e.g. dynamic sampling drops groups whose
       rewards are all equal) and which completions of a kept group contribute tokens (False = masked out,
       e.g. overlong filtering of truncated completions). Keep-all when the algorithm filters nothing.
    3. ``advantages(rewards [G, n]) -> [G, n]``: finite, per completion; computed within each group, so a
       group's advantages do not depend on the other groups.
    4. ``loss(logprobs, old_logprobs, advantages, mask, entropy=None) -> (loss, metrics)``: all ``[B, T]``
       (``advantages`` already broadcast to tokens; ``mask`` bool, True for tokens that count; ``entropy``
       the policy's per-token entropy if the caller has it). ``logprobs`` carry the gradient. The loss is a
       finite scalar whatever the ratios (masked tokens may hold anything, even inf or NaN, and must not
       reach the loss or its gradient); ``metrics`` are floats (clip fractions, approximate KL), with
       ``metrics["entropy"]`` the mean of ``entropy`` over the unmasked tokens when it is given.
    5. ``batch_weight(mask [B, T]) -> float``: the weight of a micro-batch in its full batch's loss:
       ``loss(full batch) == sum_m batch_weight(mask_m) * loss(micro-batch m) / sum_m batch_weight(mask_m)``
       for any split of the batch's rows (the token count for a token mean, the row count for a mean over
       sequences), so a step may be split into micro-batches without changing it.
    """

    min_group_size: int

    def shape_rewards(self, rewards: Tensor, lengths: Tensor, max_new_tokens: int) -> Tensor: ...

    def filter(self, rewards: Tensor, truncated: Tensor) -> tuple[Tensor, Tensor]: ...

    def advantages(self, rewards: Tensor) -> Tensor: ...

    def loss(
        self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, entropy: Tensor | None = None
    ) -> tuple[Tensor, dict[str, float]]: ...

    def batch_weight(self, mask: Tensor) -> float: ...


@runtime_checkable
class Baseline(Protocol):
    """A reference predictor scored beside the model on the same held-out windows (e.g. a k-mer model
    fitted on the training data).

    Built by its record's target as ``build(config, train: megaseq.data.Corpus)``: ``train`` is the recipe's
    ``data.train`` (a data source's name with its config, or a FASTA path; ``str(train)`` is what the recipe
    wrote, ``train.alphabet`` its alphabet), which a baseline that learns from data fits on, reading it with
    ``megaseq.data.tokenized(train)``. Fitting is done once: a plugin caches what it fitted under
    ``megaseq.data.default_cache_dir() / PLUGIN``, keyed by what the fit depends on (the resolved file's path,
    size and modification time, ``megaseq.data.resolve_fasta(train)``, the alphabet and the config) and written
    whole or not at all (to a temporary file renamed into place), so that every run and rank shares it.

    ``label`` names its column in the evaluation's results (e.g. ``kmer-8``). ``token_losses(inputs [B, T],
    targets [B, T])`` (int64 token ids of the data's alphabet, ``megaseq.data.tokenizer``; DNA: A C G T N =
    0..4) returns float64 ``[B, T]`` losses in nats, finite and non-negative, 0 where the target is the
    alphabet's unknown symbol (N), ``-log p(target)`` of a distribution over the alphabet's letters (the
    probabilities of every letter as the target sum to 1). The target at position p is predicted from
    ``inputs[:, : p + 1]`` only: never from a later input (``inputs[:, p + 1]`` is ``targets[:, p]``), from
    ``targets`` (the target itself, or an earlier one: the baseline looks a target up, it never reads the
    targets as context), from another row of the batch or from outside the window. The record declares the
    alphabets it handles (``BaselineSpec.alphabets``). ``megaseq_testkit.baseline.BaselineConformance`` checks
    all of this.
    """

    label: str

    def token_losses(self, inputs: Tensor, targets: Tensor) -> Tensor: ...


MODEL_SCORER = "model"  # the model's scorer label in the held-out evaluation (baselines use their own labels)


@dataclass(frozen=True)
class EvalInfo:
    """What an eval analysis is built for: ``source`` (the recipe, for one-line errors), ``seq_len`` (targets
    per window), ``windows`` (how many held-out windows are scored, numbered ``0 .. windows - 1``),
    ``baselines``, the labels of the baselines scored beside the model, in order, and ``alphabet``, the data's
    (``megaseq.alphabets``; what the window's token ids are). The property ``scorers`` (not a field) is every
    scorer the analysis is fed: the model first, then the baselines."""

    source: str
    seq_len: int
    windows: int
    baselines: tuple[str, ...]
    alphabet: Alphabet = DNA

    @property
    def scorers(self) -> tuple[str, ...]:
        """Every scorer the analysis is fed: the model (:data:`MODEL_SCORER`) first, then the baselines."""
        return (MODEL_SCORER, *self.baselines)


@runtime_checkable
class EvalAnalysis(Protocol):
    """A per-target analysis of every scorer's losses on the held-out windows (e.g. bits/base by
    the distance back to the last earlier occurrence of each target's preceding k-mer).

    Built by its record's target as ``build(config, info: EvalInfo)``; a recipe it cannot serve (e.g. it
    needs a baseline and none is scored) raises ``megaseq.errors.ConfigError`` there, in one line, before
    anything is scored. ``add(scorer, window, ids, losses, weights)`` is called exactly once per scorer of
    ``info.scorers`` and window, in any order: ``ids`` the window's ``seq_len + 1`` token ids (int64, in
    ``info.alphabet``, ``megaseq.data.tokenizer``: for DNA A C G T N = 0..4; inputs ``ids[:-1]``, targets
    ``ids[1:]``), ``losses`` the scorer's ``seq_len`` target losses in nats (float64) and ``weights`` their loss
    weights (float64, 0 = not scored: the loss there may be anything, even inf or NaN, and must not count).

    Every scored target counts by its weight, whichever window holds it: sums over targets, never averages per
    window first (windows hold different numbers of scored targets). A target's context is the part of its
    window after the last unknown token (N) before it: core joins a corpus's records (packed documents) with
    one N, so what lies before an N may be another document; an analysis never relates a target to tokens
    across one. The record declares the alphabets it handles (``EvalAnalysisSpec.alphabets``).
    ``finish(out_dir)`` is
    called once after every ``add``: it returns ``(result, table)``, a dict that ``json.dumps`` writes
    without NaN or infinity (it goes under ``"analyses"`` in ``heldout.json``) and a text table for the
    console, and writes its own files (plots) into ``out_dir`` only, nothing when ``out_dir`` is ``None``.
    ``megaseq_testkit.eval_analysis.EvalAnalysisConformance`` checks all of this.
    """

    def add(self, scorer: str, window: int, ids: Any, losses: Any, weights: Any) -> None: ...

    def finish(self, out_dir: Any) -> tuple[dict[str, Any], str]: ...


@runtime_checkable
class DataTransform(Protocol):
    """A change made to every training micro-batch: an augmentation (the reverse complement of DNA), planted
    repeats, a curriculum of them.

    Built by its record's target as ``build(config)``, which raises ``megaseq.errors.ConfigError`` (one line
    naming the key and what is allowed) for a config its schema admits but it cannot serve; core prefixes the
    recipe and ``[data_transform.NAME]``. A recipe applies transforms with ``data.transforms = ["NAME", ...]``,
    in that order, each configured in ``[data_transform.NAME]``; the record declares ``changes_distribution``
    (``megaseq.records.DataTransformSpec``). Core calls
    ``transform(batch, step=step, generator=generator) -> Batch``:

    - On training micro-batches only. Evaluation never calls it, and nothing else may change: a transform
      never touches held-out windows, the token cache, data paths or ``megaseq.data`` itself; all it changes
      is the batch it returns.
    - On the whole global micro-batch (every data-parallel rank transforms the same rows, then takes its
      share, so a layout equals one process), after the window-length schedule's cut (``data.schedule``: the
      rows are the stage's windows) and before the batch is mapped into the model's vocabulary
      (``data.token_ids``): ``batch`` (``megaseq.data.windows.Batch``, on the CPU) holds token ids of the
      data's alphabet, A C G T N = 0..4 (``megaseq.data.tokenizer``), ``inputs`` and ``targets`` int64
      ``[B, T]``, ``weights`` float32 ``[B, T]`` (the targets' loss weights: 0 on N, ``data.softmask_weight``
      on soft-masked bases), and each row is a window: ``targets[:, :-1] == inputs[:, 1:]``.
    - It returns a batch of the same shapes and dtypes, ids in 0..4, finite weights >= 0, 0 on every N target,
      each row still a window; it never changes ``batch`` in place (the caller's tensors stay as they were).
    - Its randomness comes from ``generator`` alone: a CPU ``torch.Generator`` that core seeds from the run's
      seed, the step, the micro-batch's index in the step and the transform's position in
      ``data.transforms`` (``megaseq.data.transforms.transform_generator``). It leaves the global generators
      (torch, numpy, ``random``) untouched. ``step`` is the optimizer step being taken, counting from 1 (a
      curriculum reads it). The result depends on ``batch``, ``step`` and ``generator`` only: the transform
      keeps no state from call to call, so a resumed run, with a freshly built transform, transforms each
      batch as the straight run did.
    - ``min_length``: the shortest window (tokens per row) it acts on; core refuses, before training, a recipe
      whose windows (``data.seq_len``, every ``data.schedule`` stage) are shorter.

    ``megaseq_testkit.data_transform.DataTransformConformance`` checks all of this.
    """

    min_length: int

    def __call__(self, batch: Batch, *, step: int, generator: torch.Generator) -> Batch: ...


def iter_modules(model: torch.nn.Module, cls: type) -> Iterator[tuple[str, Any]]:
    """``(name, module)`` for each submodule that is an instance of ``cls``: how a plugin finds its own
    modules in a model from its lifecycle hooks."""
    for name, module in model.named_modules():
        if isinstance(module, cls):
            yield name, module


__all__ = [
    "LOAD_STAT_KEYS",
    "MODEL_SCORER",
    "Attention",
    "Baseline",
    "ContextParallel",
    "DataTransform",
    "EvalAnalysis",
    "EvalInfo",
    "FeedForward",
    "ForwardContext",
    "KeptValues",
    "MemoryPolicy",
    "MoE",
    "ModelDims",
    "RLAlgorithm",
    "RoutingReplay",
    "SequenceTiling",
    "Tile",
    "iter_modules",
    "recomputing",
]
