"""Tensor parallelism of the DSA layer: the check the conformance suite runs (test_conformance.py) catches a
layer whose ranks train the indexer towards their own heads' attention only; the triton backend passes it too
(its selection of each rank's share of the queries, its sparse attention kernel on each rank's heads); what a
rank sends grows with the length times the top-k, not with the length squared; heads that tp does not divide
are refused when the layer is built, in one line; and what a rank keeps for backward is what the layer's
estimate says at its tp_size (its gathered input and the tensors every head reads whole, its heads' share of
the rest), and so are the parameters it builds."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from megaseq.records import ModelDims
from megaseq_dsa.config import DSAConfig
from megaseq_dsa.layer import memory_estimate
from megaseq_dsa.testing import tp_collective_bytes, tp_saved_bytes
from megaseq_testkit import build_component
from megaseq_testkit.distributed import run_gloo
from megaseq_testkit.tensor_parallel import check_tensor_parallel

CONFIG = {"n_heads": 4, "head_dim": 8, "q_lora_rank": 12, "kv_lora_rank": 8, "index_heads": 4, "index_dim": 8,
          "topk": 8}


def test_the_check_catches_ranks_whose_indexer_target_is_their_own_heads():
    # a wrong gradient of the indexer, not a crash: the wrong component runs the same collectives
    with pytest.raises(AssertionError, match=r"under tp=2 gradient of indexer\."):
        check_tensor_parallel("attention", "dsa", CONFIG, factory="megaseq_dsa.testing:build_own_heads_target")


@pytest.mark.slow  # the Triton interpreter, two gloo ranks
def test_the_triton_backend_passes_the_tensor_parallel_check():
    """On CUDA when present, else with the kernels in the Triton CPU interpreter (a subprocess, so that
    TRITON_INTERPRET is set before triton is imported)."""
    pytest.importorskip("triton")
    env = {**os.environ} if torch.cuda.is_available() else {**os.environ, "TRITON_INTERPRET": "1"}
    code = ("from megaseq_testkit.tensor_parallel import check_tensor_parallel; "
            f"check_tensor_parallel('attention', 'dsa', {{**{CONFIG!r}, 'backend': 'triton'}})")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("mode", ["sparse", "dense_warmup"])
def test_what_a_rank_sends_grows_with_length_times_topk_not_length_squared(mode: str):
    """Forward and backward at 4x the length send at most about 4x the bytes in sparse mode: the sequence
    gathered and scattered, the selected keys' indices gathered and the KL's target over them summed, all
    linear in the length at a fixed top-k. Summing each query block's scores over every earlier key across
    the ranks before the top-k (the indexer's heads split over ranks) would send 16x. The dense warm-up's KL
    target is over every visible key: quadratic by design (a short-context phase)."""
    config = {**CONFIG, "topk": 16, "mode": mode}
    short, long = run_gloo(2, tp_collective_bytes, config, 16, [256, 1024])[0]
    if mode == "sparse":
        assert long / short < 4.5, (short, long)
    else:
        assert long / short > 8, (short, long)


def test_query_heads_that_tp_does_not_divide_are_refused_and_the_whole_indexer_is_not():
    with pytest.raises(ValueError, match=r"^attention.dsa: n_heads 3 is not a multiple of tp 2$"):
        build_component("attention", "dsa", {**CONFIG, "n_heads": 3}, ModelDims(d_model=16, n_layers=2, vocab_size=8, tp_size=2))
    build_component("attention", "dsa", {**CONFIG, "index_heads": 3}, ModelDims(d_model=16, n_layers=2, vocab_size=8, tp_size=2))


@pytest.mark.parametrize(
    "config",
    [
        {"mode": "sparse", "topk": 64, "index_pool": 4},
        {"mode": "dense_warmup", "freeze_main_in_warmup": False, "rope": True, "rope_dim": 8},
    ],
    ids=["sparse", "dense-rope"],
)
def test_a_rank_keeps_what_its_estimate_says(config: dict):
    """Bytes autograd keeps per gathered token on each of 2 ranks (the slope between two lengths) equal the
    estimate at ``tp_size`` 2: the input it gathers, what every head reads whole, its heads' share of the rest.
    Halving the one-process estimate (what a planner that divided it by tp would count) is short of it."""
    full = {**CONFIG, "n_heads": 4, "index_heads": 2, "query_chunk": 16, **config}
    d_model = 16
    estimate = memory_estimate(DSAConfig(**full), ModelDims(d_model, 2, 8, tp_size=2), 512)
    for short, long in run_gloo(2, tp_saved_bytes, full, d_model, [256, 512]):
        assert (long - short) / 256 == estimate.saved_per_token
    whole = memory_estimate(DSAConfig(**full), ModelDims(d_model, 2, 8), 512)
    assert whole.saved_per_token / 2 < estimate.saved_per_token


@pytest.mark.parametrize("config", [{}, {"rope": True, "rope_dim": 8}], ids=["plain", "rope"])
def test_the_estimate_gives_a_ranks_parameters(config: dict):
    """The estimate at ``tp_size`` gives the bytes rank 0 builds at tp = 1, 2 and 4 (the down-projections every
    head reads are whole on each rank, so halving the one-process count would be short of them)."""
    full = {**CONFIG, **config}
    for tp in (1, 2, 4):
        dims = ModelDims(d_model=16, n_layers=2, vocab_size=8, tp_size=tp)
        rank = build_component("attention", "dsa", full, dims)
        built = sum(p.numel() * p.element_size() for p in rank.parameters())
        assert built == memory_estimate(DSAConfig(**full), dims, 64).parameters
        assert tp == 1 or built > memory_estimate(DSAConfig(**full), ModelDims(16, 2, 8), 64).parameters // tp
