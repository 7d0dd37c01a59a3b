"""Order-k nucleotide Markov baseline, scored on exactly the windows and positions the model sees.

fit: for every order j = 0..k, count (context of the j previous bases, next base) over A/C/G/T, skipping
any context or target that contains N. Contexts are rolling base-4 codes (most recent base = lowest digit),
so the order-j code is the order-k code modulo 4^j and one pass over the sequence gives every order.

Probabilities use add-alpha smoothing, p(x | c) = (n(c, x) + alpha) / (n(c) + 4 alpha), with alpha = 0.5
by default (the Krichevsky-Trofimov estimator): on a chromosome almost every order-8 context is seen
hundreds of times, so smoothing only matters for rare contexts, where 0.5 is a standard unbiased choice.

token_losses: the target at window position p is predicted from the window's own previous tokens only:
the last min(p + 1, k) input tokens, shortened to those after the most recent N. So position 0 uses an
order-1 context, and the baseline never sees context the model could not.

As the ``markov`` baseline (``eval.baselines = ["markov"]``, ``[baseline.markov] order = K``) it is fitted on
the recipe's ``data.train`` once and the counts cached next to the token cache (:func:`fitted_markov`).
"""

import hashlib
import os
import sys
from pathlib import Path

import numpy as np
import torch

from megaseq.data.sources import default_cache_dir, resolve_fasta, tokenized
from megaseq.data.tokenizer import N_ID, TOKEN_ID_MASK
from megaseq_genome.config import MAX_MARKOV_ORDER, MarkovConfig

_FIT_BLOCK = 1 << 22


def _context_codes(ids: np.ndarray, order: int) -> tuple[np.ndarray, np.ndarray]:
    """For each position t along the last axis of `ids` (0..4), the base-4 code of ids[.., t-order+1 .. t]
    (ids[t] lowest digit, N as 0) and the number of consecutive non-N tokens ending at t (inclusive)."""
    is_n = ids == N_ID
    digits = np.where(is_n, 0, ids).astype(np.int64)
    codes = np.zeros(ids.shape, dtype=np.int64)
    for back in range(order):
        codes[..., back:] += digits[..., : ids.shape[-1] - back] << (2 * back)
    positions = np.broadcast_to(np.arange(ids.shape[-1]), ids.shape)
    last_n = np.maximum.accumulate(np.where(is_n, positions, -1), axis=-1)
    return codes, positions - last_n


class MarkovBaseline:
    """Order-k Markov model over A/C/G/T with add-alpha smoothing (see module docstring)."""

    def __init__(self, order: int, alpha: float = 0.5) -> None:
        if not 0 <= order <= MAX_MARKOV_ORDER:
            raise ValueError(f"Markov order must be in 0..{MAX_MARKOV_ORDER}, got {order}")
        if alpha <= 0:
            raise ValueError(f"alpha must be > 0, got {alpha}")
        self.order = order
        self.alpha = alpha
        self.label = f"markov-{order}"
        # counts[j] has shape [4**j, 4]: row = context code of the j previous bases, column = next base.
        self.counts = [np.zeros((4**j, 4), dtype=np.int64) for j in range(order + 1)]
        self._refresh()

    def _refresh(self) -> None:
        tables = [
            np.log(c + self.alpha) - np.log(c.sum(1, keepdims=True) + 4 * self.alpha) for c in self.counts
        ]
        self._log_probs = np.concatenate([t.ravel() for t in tables])
        self._table_offsets = np.cumsum([0] + [t.size for t in tables])[:-1]

    def log_prob_table(self, context_order: int) -> np.ndarray:
        """log p(next base | context), [4**context_order, 4]; row = base-4 code, most recent base lowest."""
        start = self._table_offsets[context_order]
        return self._log_probs[start : start + 4 ** (context_order + 1)].reshape(4**context_order, 4)

    def fit(self, tokens: np.ndarray) -> "MarkovBaseline":
        """Add the counts of a token array (uint8 token bytes or ids; records separated by N)."""
        k = self.order
        for begin in range(0, len(tokens), _FIT_BLOCK):
            block = np.asarray(tokens[begin : begin + _FIT_BLOCK]) & TOKEN_ID_MASK
            # Prefix each block with the tokens its first targets need as context; the sequence start
            # behaves like an N (no context before it).
            if begin == 0:
                before = np.array([N_ID], dtype=np.uint8)
            else:
                before = np.asarray(tokens[begin - max(k, 1) : begin]) & TOKEN_ID_MASK
            segment = np.concatenate([before, block])
            history = len(before)
            # The context of target t is the tokens before it, i.e. the codes ending at t - 1.
            codes, run = _context_codes(segment[:-1], k)
            codes, run, targets = codes[history - 1 :], run[history - 1 :], segment[history:].astype(np.int64)
            usable = targets != N_ID
            for j in range(k + 1):
                chosen = usable & (run >= j)
                cells = (codes[chosen] & (4**j - 1)) * 4 + targets[chosen]
                self.counts[j] += np.bincount(cells, minlength=4 ** (j + 1)).reshape(-1, 4)
        self._refresh()
        return self

    def token_losses(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Loss in nats (float64) of each target given its in-window context; 0 where the target is N."""
        ids = inputs.detach().cpu().numpy().astype(np.int64)
        wanted = targets.detach().cpu().numpy().astype(np.int64)
        codes, run = _context_codes(ids, self.order)
        context_order = np.minimum(run, self.order)
        cells = (
            self._table_offsets[context_order] + (codes & (4**context_order - 1)) * 4 + np.minimum(wanted, 3)
        )
        losses = np.where(wanted == N_ID, 0.0, -self._log_probs[cells])
        return torch.from_numpy(losses).to(inputs.device)

    def save(self, path: str | Path) -> None:
        """Written whole or not at all (a temporary file renamed into place): the cache is shared by every run,
        and a run stopped mid-write must not leave counts that a later run would load."""
        path = Path(path)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            with tmp.open("wb") as f:
                np.savez(f, order=self.order, alpha=self.alpha,
                         counts=np.concatenate([c.ravel() for c in self.counts]))
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    @classmethod
    def load(cls, path: str | Path) -> "MarkovBaseline":
        with np.load(path) as saved:
            model = cls(int(saved["order"]), float(saved["alpha"]))
            flat = saved["counts"]
        sizes = [c.size for c in model.counts]
        if flat.size != sum(sizes):
            raise ValueError(
                f"{path}: counts have {flat.size} entries, expected {sum(sizes)} for order {model.order}"
            )
        model.counts = [part.reshape(-1, 4) for part in np.split(flat, np.cumsum(sizes)[:-1])]
        model._refresh()
        return model


def fitted_markov(train: str, order: int) -> MarkovBaseline:
    """The order-``order`` Markov baseline fitted on ``train`` (a data source or FASTA path), from the cache or
    fitted once."""
    source = resolve_fasta(train)
    stat = source.stat()
    key = hashlib.sha256(f"{source.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{order}".encode()).hexdigest()[:16]
    path = default_cache_dir() / "markov" / f"order{order}-{key}.npz"
    if path.exists():
        return MarkovBaseline.load(path)
    print(f"fitting the order-{order} Markov baseline on {train} ...", file=sys.stderr)
    model = MarkovBaseline(order).fit(tokenized(train))
    path.parent.mkdir(parents=True, exist_ok=True)
    model.save(path)
    return model


def build(config: MarkovConfig, train: str) -> MarkovBaseline:
    """The ``markov`` baseline (``megaseq.contracts.Baseline``) of ``[baseline.markov]``, fitted on ``train``."""
    return fitted_markov(train, config.order)
