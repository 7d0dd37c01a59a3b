"""The ``recompute`` and ``offload`` memory policies (see ``megaseq.contracts.MemoryPolicy``) and what the
memory planner models them as (``megaseq.records.MemoryEffect``)."""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from megaseq.contracts import recomputing
from megaseq.errors import UserError
from megaseq.memory import Layer, model_layers
from megaseq.records import MemoryEffect
from megaseq_offload.config import OffloadConfig, RecomputeConfig
from megaseq_offload.recompute import recomputed, tiled_block_forward
from megaseq_offload.stores import (
    MAP_LARGER_THAN,
    PinnedPool,
    ScratchFile,
    check_scratch_dir,
    default_scratch_dir,
    map_large_allocations,
)


class RecomputePolicy:
    """Keeps only the input of each chosen part (block, attention or feed-forward) of each chosen layer and
    re-runs the part in backward; with ``tile_tokens``, whole blocks run tile by tile."""

    def __init__(self, config: RecomputeConfig) -> None:
        self.config = config

    def select(self, model: nn.Module) -> list[Layer]:
        layers = model_layers(model)
        first, stop = self.config.layers or (0, len(layers))
        chosen = [layer for layer in layers if first <= layer.index < stop]
        if not chosen:
            raise UserError(
                f"memory_policy.recompute.layers [{first}, {stop}) selects no layer of this {len(layers)}-layer model"
            )
        if self.config.tile_tokens is not None:
            untileable = [f"{layer.index} ({layer.attention})" for layer in chosen if not layer.tiles]
            if untileable:
                raise UserError(
                    f"memory_policy.recompute.tile_tokens: the attention of layer {', '.join(untileable)} cannot run "
                    "in sequence tiles (its record does not declare sequence_tiling); restrict layers or drop tile_tokens"
                )
        return chosen

    def apply(self, model: nn.Module) -> None:
        tile, reuse = self.config.tile_tokens, self.config.reuse_kept
        for layer in self.select(model):
            if tile is None:
                layer.wrap(self.config.part, lambda module, fwd: recomputed(module, fwd, reuse))
            else:
                layer.wrap("block", lambda block, fwd, ffn=layer.ffn_tiles: tiled_block_forward(block, fwd, tile, ffn, reuse))

    def step(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # nothing is held between steps


class _OffloadHooks:
    """Saved-tensor hooks of one step: large activations go to the store, come back when backward needs them."""

    def __init__(self, store: ScratchFile | PinnedPool, device: torch.device, min_bytes: int, parameters: set[int]) -> None:
        self.store, self.device, self.min_bytes, self.parameters = store, device, min_bytes, parameters
        self.seen: dict[int, tuple[weakref.ref[Tensor], weakref.ref[Any]]] = {}
        self.live = 0
        self.moved = 0
        self.largest_kept = 0
        self.saved = 0  # tensors autograd saved in this step (none when it ran only no-grad forwards)
        self.open = True

    def pack(self, t: Tensor) -> Any:
        # What stays is kept detached: a saved output kept as itself would hold its own graph node, a cycle
        # through C++ that leaks the whole graph of a forward that fails before its backward.
        if recomputing():  # saved by a re-run in backward: used at once, not worth moving
            return t.detach()
        self.saved += 1
        nbytes = t.numel() * t.element_size()
        if t.device != self.device or t.untyped_storage().data_ptr() in self.parameters or nbytes < self.min_bytes:
            self.largest_kept = max(self.largest_kept, nbytes)
            return t.detach()
        ref, handle_ref = self.seen.get(id(t), (None, None))
        if ref is not None and ref() is t and (handle := handle_ref()) is not None:  # the same tensor saved again
            return handle
        handle = self.store.put(t)
        self.seen[id(t)] = (weakref.ref(t), weakref.ref(handle))
        self.live += 1
        self.moved += nbytes
        weakref.finalize(handle, self._released)
        return handle

    def unpack(self, packed: Any) -> Tensor:
        return packed if isinstance(packed, Tensor) else self.store.get(packed)

    def _released(self) -> None:
        self.live -= 1
        if self.live == 0 and self.open:
            self.store.reset()
            self.seen.clear()


class OffloadPolicy:
    """Moves every saved tensor of at least ``min_bytes`` out of device memory during forward and brings it
    back in backward (CUDA: a pinned host pool; CPU: a scratch file on local disk). Combined with
    ``recompute``, what is saved is mostly the recomputed parts' inputs."""

    def __init__(self, config: OffloadConfig) -> None:
        self.config = config
        self.model: nn.Module | None = None
        self.device = torch.device("cpu")
        self.scratch = None
        self.pool: PinnedPool | None = None  # CUDA: made at the first step, kept (page-locking is slow)
        self.checked = False
        self.last_moved = 0

    def apply(self, model: nn.Module) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        if self.device.type == "cpu":
            self.scratch = check_scratch_dir(self.config.scratch_dir or default_scratch_dir(), self.config.pool_bytes or 0)
            map_large_allocations()  # else glibc's heap keeps what leaves for disk resident
        elif self.device.type != "cuda":
            raise UserError(f"memory_policy.offload runs on cpu or cuda, not {self.device.type}")

    def _store(self) -> ScratchFile | PinnedPool:
        """The step's store: a new scratch file (CPU), or the pool kept from the last step (CUDA)."""
        reserve = self.config.pool_bytes or 0
        if self.device.type == "cpu":
            assert self.scratch is not None
            return ScratchFile(self.scratch, reserve)
        if self.pool is None:
            self.pool = PinnedPool(self.device, reserve)
        self.pool.begin()
        return self.pool

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        if self.model is None:
            raise RuntimeError("memory_policy.offload: step() before apply(model)")
        parameters = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        store = self._store()
        hooks = _OffloadHooks(store, self.device, self.config.min_bytes, parameters)
        try:
            with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
                yield
        finally:
            hooks.open = False
            if store is not self.pool:
                store.close()
        self.last_moved = hooks.moved
        if not self.checked and hooks.saved and hooks.moved == 0:  # a no-grad-only step says nothing
            raise UserError(
                f"memory_policy.offload: a whole step saved no tensor of at least min_bytes = {self.config.min_bytes} "
                f"(the largest was {hooks.largest_kept} bytes), so there is nothing to offload; lower min_bytes or "
                "remove the policy"
            )
        self.checked = self.checked or hooks.saved > 0


def build_recompute(config: RecomputeConfig) -> RecomputePolicy:
    return RecomputePolicy(config)


def build_offload(config: OffloadConfig) -> OffloadPolicy:
    return OffloadPolicy(config)


# Extra step time, for ranking policy sets, per device kind (megaseq.records.MemoryEffect.time_costs).
# CPU, measured: one step of recipes/genome-cpu.toml at 65,536 tokens, one thread, a fresh process each, the
# same busy machine (docs/results.md, "Policy costs"): no policy 76.8 CPU s, recompute(part=block) 110.8 s
# (+44%), offload 141.5 s (+84%: the scratch file's writes and reads and the page faults of mapped allocations).
# CUDA: offload +21%, reported for the GLM-5.3-Flash run at 256k (checkpoint inputs to pinned host memory);
# recompute estimated: a forward is about a third of forward + backward, so re-running every block costs
# about +33%. The attention and the feed-forward alone are estimated as the same shares of the block's cost on
# both kinds (0.3 and 0.6 of it). Tiles add a little per halving of the tile (carried state, repeated key
# concatenation), an estimate.
_RECOMPUTE_BLOCK_COST = {"cpu": 0.44, "cuda": 0.33}
_RECOMPUTE_SHARE = {"ffn": 0.3, "attention": 0.6, "block": 1.0}
_TILE_COST, _TILE_COST_PER_HALVING = 0.03, 0.01
_OFFLOAD_COST = {"cpu": 0.84, "cuda": 0.21}


def recompute_effect(config: RecomputeConfig) -> MemoryEffect:
    tiles = 0.0
    if config.tile_tokens is not None:
        tiles = _TILE_COST + _TILE_COST_PER_HALVING * max(0.0, math.log2(2**20 / config.tile_tokens))
    costs = {kind: _RECOMPUTE_SHARE[config.part] * block + tiles for kind, block in _RECOMPUTE_BLOCK_COST.items()}
    return MemoryEffect(recompute=config.part, layers=config.layers, tile_tokens=config.tile_tokens,
                        reuses_kept=config.reuse_kept, time_cost=costs["cuda"], time_costs=costs)


def offload_effect(config: OffloadConfig) -> MemoryEffect:
    return MemoryEffect(offload_min_bytes=config.min_bytes, maps_allocations_from=MAP_LARGER_THAN,
                        time_cost=_OFFLOAD_COST["cuda"], time_costs=_OFFLOAD_COST)
