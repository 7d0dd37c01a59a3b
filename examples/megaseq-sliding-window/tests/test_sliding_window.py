"""Tests of the sliding-window attention plugin: the megaseq conformance suite, a dense reference, and use."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, ClassVar

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megaseq.contracts import ForwardContext
from megaseq.records import ModelDims
from megaseq_sliding_window.config import SlidingWindowConfig
from megaseq_sliding_window.layer import SlidingWindowAttention, rope
from megaseq_testkit import build_component, fresh_plugins
from megaseq_testkit.attention import AttentionConformance, assert_close

# --------------------------------------------------------------------------------------------- conformance


class TestSlidingWindow(AttentionConformance):
    """Window 5, smaller than every test length (48, the documents, the cp length 32); blocks of 4 queries, so
    the sequence, the documents and each context-parallel segment span several blocks."""

    name = "sliding-window"
    config: ClassVar[dict[str, Any]] = {"n_heads": 2, "window": 5, "block_size": 4}


class TestSlidingWindowOne(AttentionConformance):
    """Window 1: each token sees only itself."""

    name = "sliding-window"
    config: ClassVar[dict[str, Any]] = {"n_heads": 2, "window": 1}


# ------------------------------------------------------------------------------------- dense reference


def dense_reference(module: SlidingWindowAttention, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None):
    """The same projections, then full [T, T] masked softmax with a band (and document) mask."""
    b, t, d = x.shape
    h, hd, w = module.n_heads, module.head_dim, module.window
    q, k, v = module.qkv(x).view(b, t, 3, h, hd).permute(2, 0, 3, 1, 4)
    pos = torch.arange(t)
    doc = torch.zeros(t, dtype=torch.long)
    if cu_seqlens is not None:
        cu = cu_seqlens.long()
        doc = torch.searchsorted(cu, pos, right=True) - 1
    rel = pos - (cu_seqlens.long()[doc] if cu_seqlens is not None else 0)
    if module.use_rope:
        q, k = rope(q, rel, module.rope_base), rope(k, rel, module.rope_base)
    diff = pos[:, None] - pos[None, :]
    mask = (diff >= 0) & (diff < w) & (doc[:, None] == doc[None, :])
    scores = (q @ k.transpose(-1, -2)) / hd**0.5
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    y = (probs @ v).transpose(1, 2).reshape(b, t, d)
    return module.out(y)


@pytest.mark.parametrize(
    ("t", "window", "n_heads", "block_size", "rope_on"),
    [
        (37, 5, 3, None, True),
        (53, 16, 2, 7, True),
        (29, 29, 1, 4, False),
        (41, 100, 2, None, True),  # window longer than the sequence: plain causal attention
        (23, 1, 3, 5, True),
        (131, 11, 3, 10, False),
    ],
)
def test_matches_dense_reference(t: int, window: int, n_heads: int, block_size: int | None, rope_on: bool) -> None:
    d_model = 6 * n_heads
    torch.manual_seed(0)
    cfg = SlidingWindowConfig(n_heads=n_heads, window=window, block_size=block_size, rope=rope_on)
    module = SlidingWindowAttention(cfg, d_model).float()
    x = torch.randn(2, t, d_model, requires_grad=True)
    out = module(x, ForwardContext())
    g = torch.randn_like(out)
    (out * g).sum().backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    module.zero_grad()
    xr = x.detach().clone().requires_grad_(True)
    ref = dense_reference(module, xr)
    (ref * g).sum().backward()
    assert_close(out, ref, 1e-5, "output")
    assert_close(x.grad, xr.grad, 1e-5, "input gradient")
    for n, p in module.named_parameters():
        assert_close(grads[n], p.grad, 1e-5, f"gradient of {n}")


def test_packed_matches_dense_reference() -> None:
    torch.manual_seed(0)
    module = SlidingWindowAttention(SlidingWindowConfig(n_heads=2, window=6, block_size=4), 16).float()
    cu = torch.tensor([0, 1, 9, 10, 31, 44], dtype=torch.int32)
    x = torch.randn(1, 44, 16)
    out = module(x, ForwardContext(cu_seqlens=cu))
    assert_close(out, dense_reference(module, x, cu), 1e-5, "packed output")


def test_decode_cache_stays_bounded() -> None:
    torch.manual_seed(0)
    module = SlidingWindowAttention(SlidingWindowConfig(n_heads=2, window=4), 16).float()
    x = torch.randn(2, 30, 16)
    with torch.no_grad():
        full = module(x, ForwardContext())
        cache = module.init_cache(2, device=x.device, dtype=x.dtype)
        outs = [module(x[:, :11], ForwardContext(), cache)]
        assert cache.k.shape[2] == 4 and cache.seen == 11
        for i in range(11, 30):
            outs.append(module(x[:, i : i + 1], ForwardContext(), cache))
            assert cache.k.shape[2] <= 4 and cache.v.shape[2] <= 4
    assert_close(torch.cat(outs, 1), full, 1e-5, "decode")


class _LargestTensor(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor):
                self.largest = max(self.largest, o.numel())
        return out


def test_memory_is_linear_in_length() -> None:
    """No tensor of the forward or backward has anything like T^2 elements."""
    t, window, heads, d = 1024, 16, 2, 16
    module = SlidingWindowAttention(SlidingWindowConfig(n_heads=heads, window=window), d).float()
    x = torch.randn(1, t, d, requires_grad=True)
    with _LargestTensor() as mode:
        module(x, ForwardContext()).sum().backward()
    block = 64
    assert mode.largest <= max(3 * t * d, heads * block * (block + window)), mode.largest
    assert mode.largest < t * t // 8


def test_config_errors() -> None:
    dims = ModelDims(d_model=30, n_layers=1, vocab_size=8)
    with pytest.raises(ValueError, match="multiple of n_heads"):
        build_component("attention", "sliding-window", {"n_heads": 4}, dims)
    with pytest.raises(Exception, match="greater than or equal to 1"):
        SlidingWindowConfig(window=0)
    with pytest.raises(Exception, match="Extra inputs"):
        SlidingWindowConfig(windw=3)
    assert SlidingWindowConfig().n_heads == 4 and SlidingWindowConfig().window == 256


# ------------------------------------------------------------------------------------------------- use


def test_listed_by_megaseq_plugins() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("MEGASEQ_PLUGINS", "MEGASEQ_DISABLE_PLUGIN_AUTOLOAD")}
    proc = subprocess.run(
        [sys.executable, "-m", "megaseq.cli", "plugins", "--json"], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    entries = {e["dist"]: e for e in json.loads(proc.stdout)}
    ours = entries["megaseq-sliding-window"]
    assert ours["status"] == "active", ours
    assert ours["name"] == "sliding-window"
    assert ours["components"] == {"attention": ["sliding-window"]}


def test_recipe_validates_and_trains(tmp_path, monkeypatch) -> None:
    from megaseq.config import validate_recipe
    from megaseq.train.trainer import Trainer

    monkeypatch.setenv("MEGASEQ_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MEGASEQ_PLUGINS", "megaseq-sliding-window")
    monkeypatch.delenv("MEGASEQ_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    plugins = fresh_plugins(autoload=True)
    raw = {
        "run": {"name": "sw-test", "seed": 0, "out_dir": str(tmp_path / "run"), "device": "cpu"},
        "data": {"train": "excerpt-chr20", "heldout": "excerpt-chrX", "seq_len": 64},
        "model": {"d_model": 16, "n_layers": 2, "layer_pattern": ["sliding-window", "sdpa"]},
        "attention": {"sliding-window": {"n_heads": 2, "window": 8}, "sdpa": {"n_heads": 2}},
        "train": {"steps": 2, "batch_size": 2, "warmup_steps": 1, "log_every": 1},
        "eval": {"windows": 2},
    }
    recipe = validate_recipe(raw, plugins, source="sw-test")
    result = Trainer(recipe, plugins, progress=False, tensorboard=False).run()
    assert result.step == 2
    assert len(result.losses) == 2 and all(torch.isfinite(torch.tensor(result.losses)))
