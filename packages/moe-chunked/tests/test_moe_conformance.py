"""The ``chunked`` strategy passes core's MoE conformance suite, built through the installed entry point.

Two configs: one whose widths suit ``grouped_mm`` (fp32 rows of 16-byte multiples), one with awkward widths
(the per-expert loop), a SwiGLU clamp that is active at the suite's input scale, and two shared experts.
"""

from megaseq.testing.moe import MoEConformance


class TestChunkedGroupedMM(MoEConformance):
    name = "chunked"
    config = {"n_experts": 8, "top_k": 2, "expert_hidden": 24, "chunk_tokens": 5, "init_std": 0.2}


class TestChunkedLoopClampShared(MoEConformance):
    name = "chunked"
    config = {
        "n_experts": 5,
        "top_k": 3,
        "expert_hidden": 7,
        "n_shared_experts": 2,
        "shared_hidden": 5,
        "swiglu_limit": 0.5,
        "routed_scaling_factor": 2.5,
        "chunk_tokens": 4,
        "init_std": 0.3,
    }
