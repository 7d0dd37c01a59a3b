"""Fixed-length training windows over a token array, and a resumable shuffled sampler.

A window is seq_len + 1 consecutive tokens: inputs are its first seq_len, targets its last seq_len. With
the default stride of seq_len, consecutive windows share one token, so every target position is scored
exactly once. Windows are chosen once, up front: a window whose targets are more than `max_n_fraction` N
(the alphabet's unknown symbol) is dropped (N runs are assembly gaps, not DNA), and so is any window whose
targets would all weigh 0, so a batch can never produce a 0/0 loss. Counting N per window uses prefix sums evaluated block by block, so
a whole-chromosome memmap is never expanded to a full-size integer array.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from megaseq.alphabets import DNA, Alphabet

if TYPE_CHECKING:
    from megaseq.config import Recipe
    from megaseq.plugins import Plugins

_PREFIX_BLOCK = 1 << 22


@dataclass
class Batch:
    """inputs/targets: token ids (DNA: 0..4), LongTensor [B, T]; weights: FloatTensor [B, T] target loss weights."""

    inputs: torch.Tensor
    targets: torch.Tensor
    weights: torch.Tensor

    def to_vocab(self, token_ids: Sequence[int] | None) -> Batch:
        """The batch in a model's own vocabulary: ``token_ids[i]`` for base i (``data.token_ids``; None: as is)."""
        if token_ids is None:
            return self
        table = torch.tensor(token_ids, dtype=torch.int64, device=self.inputs.device)
        return Batch(table[self.inputs], table[self.targets], self.weights)

    def cut(self, length: int) -> Batch:
        """Each row cut into windows of ``length`` tokens, in order (a window-length schedule's stage): row r's
        targets are its inputs shifted by one, so the pieces are windows whose contexts start at their cut.
        The same targets and weights, only shorter contexts; ``length`` divides the rows' length."""
        if length == self.inputs.shape[1]:
            return self
        return Batch(*(t.reshape(-1, length) for t in (self.inputs, self.targets, self.weights)))


def _prefix_counts(
    tokens: np.ndarray, positions: np.ndarray, indicator: Callable[[np.ndarray], np.ndarray]
) -> np.ndarray:
    """For sorted `positions` in [0, len(tokens)]: how many tokens[:p] satisfy `indicator`."""
    out = np.empty(len(positions), dtype=np.int64)
    done = 0  # positions[:done] are filled
    total = 0  # indicator count over the blocks already scanned
    for begin in range(0, len(tokens), _PREFIX_BLOCK):
        block_counts = np.cumsum(indicator(np.asarray(tokens[begin : begin + _PREFIX_BLOCK])), dtype=np.int64)
        end = begin + len(block_counts)
        upto = int(np.searchsorted(positions, end, side="right"))
        offsets = positions[done:upto] - begin
        out[done:upto] = total + np.where(offsets > 0, block_counts[np.maximum(offsets - 1, 0)], 0)
        total += int(block_counts[-1])
        done = upto
    return out


class GenomeWindows:
    """Windows of `seq_len + 1` tokens starting every `stride` tokens (default: seq_len), filtered as above.

    tokens: uint8 token bytes from `megaseq.data.tokenized` (soft-mask flag allowed) in ``alphabet``.
    softmask_weight: loss weight of soft-masked (lower-case) targets; unknown (N) targets always weigh 0.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        *,
        max_n_fraction: float = 0.5,
        softmask_weight: float = 1.0,
        stride: int | None = None,
        alphabet: Alphabet = DNA,
    ) -> None:
        stride = seq_len if stride is None else stride
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if stride < 1:
            raise ValueError(f"stride must be >= 1, got {stride}")
        if not 0.0 <= max_n_fraction <= 1.0:
            raise ValueError(f"max_n_fraction must be in [0, 1], got {max_n_fraction}")
        if softmask_weight < 0.0:
            raise ValueError(f"softmask_weight must be >= 0, got {softmask_weight}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.softmask_weight = softmask_weight
        self.alphabet = alphabet
        unknown, mask, flag = alphabet.unknown_id, alphabet.id_mask, alphabet.softmask_flag
        candidates = np.arange(0, max(len(tokens) - seq_len, 0), stride, dtype=np.int64)
        # Targets of the window at s are tokens[s + 1 : s + seq_len + 1].
        bounds = np.concatenate([candidates + 1, candidates + seq_len + 1])
        order = np.argsort(bounds, kind="stable")

        def targets_count(indicator: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
            prefix = np.empty(len(bounds), dtype=np.int64)
            prefix[order] = _prefix_counts(tokens, bounds[order], indicator)
            return prefix[len(candidates) :] - prefix[: len(candidates)]

        n_targets = targets_count(lambda block: (block & mask) == unknown)
        keep = n_targets <= max_n_fraction * seq_len
        if softmask_weight == 0.0:
            zero_weight = targets_count(
                lambda block: ((block & mask) == unknown) | (block & flag != 0)
            )
        else:
            zero_weight = n_targets
        keep &= zero_weight < seq_len
        # May be empty (sequence too short or all N); the caller reports that with its own context.
        self.starts: np.ndarray = candidates[keep]

    def __len__(self) -> int:
        return len(self.starts)

    def batch(self, indices: Sequence[int]) -> Batch:
        """The windows `indices` (into `starts`) as a Batch."""
        span = np.arange(self.seq_len + 1)
        windows = np.asarray(self.tokens)[self.starts[np.asarray(indices, dtype=np.int64)][:, None] + span]
        ids = torch.from_numpy((windows & self.alphabet.id_mask).astype(np.int64))
        targets = ids[:, 1:]
        soft = torch.from_numpy((windows[:, 1:] & self.alphabet.softmask_flag) != 0)
        weights = torch.where(soft, self.softmask_weight, 1.0).to(torch.float32)
        weights[targets == self.alphabet.unknown_id] = 0.0
        return Batch(inputs=ids[:, :-1], targets=targets, weights=weights)


class WindowSampler:
    """Endless batches of window indices: epoch e visits every window once in the order
    `permutation(seed, e)`; a batch that runs past the end of an epoch continues into the next one.
    The state is (epoch, position), so a resumed run draws exactly the batches it would have drawn."""

    def __init__(self, n_windows: int, batch_size: int, seed: int) -> None:
        if n_windows < 1:
            raise ValueError(f"n_windows must be >= 1, got {n_windows}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.n_windows = n_windows
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)

    def next_indices(self) -> list[int]:
        indices: list[int] = []
        while len(indices) < self.batch_size:
            if self.position == self.n_windows:
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            take = min(self.batch_size - len(indices), self.n_windows - self.position)
            indices.extend(self._order[self.position : self.position + take].tolist())
            self.position += take
        return indices

    def state_dict(self) -> dict:
        return {
            "n_windows": self.n_windows,
            "seed": self.seed,
            "epoch": self.epoch,
            "position": self.position,
        }

    def load_state_dict(self, state: dict) -> None:
        if (state["n_windows"], state["seed"]) != (self.n_windows, self.seed):
            raise ValueError(
                f"sampler state is for {state['n_windows']} windows with seed {state['seed']}, but this "
                f"sampler has {self.n_windows} windows with seed {self.seed}: the data or the seed changed"
            )
        self.epoch = state["epoch"]
        self.position = state["position"]
        self._order = self._permutation(self.epoch)


def recipe_windows(recipe: Recipe, which: str, plugins: Plugins | None = None) -> GenomeWindows:
    """The windows of ``data.train`` or ``data.heldout``; unreadable or unusable data is a one-line error."""
    from megaseq.data.errors import DataError
    from megaseq.data.sources import tokenized

    d = recipe.data
    spec = getattr(d, which)
    alphabet = recipe.alphabet
    try:
        tokens = tokenized(recipe.corpus(which, plugins), plugins=plugins)
    except DataError as exc:
        raise DataError(f"{recipe.source}: data.{which}: {exc}") from None
    windows = GenomeWindows(tokens, d.seq_len, max_n_fraction=d.max_n_fraction, softmask_weight=d.softmask_weight,
                            alphabet=alphabet)
    if len(windows) == 0:
        raise DataError(
            f"{recipe.source}: data.{which} {spec!r} has no window of data.seq_len {d.seq_len} {alphabet.unit}s with "
            f"at most data.max_n_fraction {d.max_n_fraction} {alphabet.unknown}"
        )
    return windows


def training_windows(recipe: Recipe, plugins: Plugins | None = None) -> GenomeWindows:
    """The trainer's data stage: the training windows; the held-out data is read too, so that a bad
    ``data.heldout`` fails before training, not after it."""
    windows = recipe_windows(recipe, "train", plugins)
    recipe_windows(recipe, "heldout", plugins)
    return windows
