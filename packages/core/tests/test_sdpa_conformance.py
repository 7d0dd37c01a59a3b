"""Core's ``sdpa`` attention passes the attention conformance suite (with and without RoPE)."""

from megaseq_testkit.attention import AttentionConformance


class TestSDPA(AttentionConformance):
    name = "sdpa"
    config = {"n_heads": 4}


class TestSDPANoPE(AttentionConformance):
    name = "sdpa"
    config = {"n_heads": 2, "head_dim": 8, "rope": False}
