"""megaseq plugin registration: the ``grch37-chr20`` and ``grch37-chrX`` data sources, the ``markov``
baseline, the ``retrieval`` eval analysis, the ``reverse-complement`` and ``planted-repeats`` data transforms and
the ``megaseq context-extension`` command.

Listing plugins imports this module, so it imports nothing heavy (no torch): targets load lazily.
"""

from __future__ import annotations

from megaseq.hookspecs import hookimpl
from megaseq.records import BaselineSpec, CommandSpec, DataSourceSpec, DataTransformSpec, EvalAnalysisSpec
from megaseq_genome.config import MarkovConfig, PlantedRepeatsConfig, RetrievalConfig, ReverseComplementConfig


@hookimpl
def megaseq_data_source() -> list[DataSourceSpec]:
    return [
        DataSourceSpec(
            name="grch37-chr20", target="megaseq_genome.sources:fetch",
            summary="human GRCh37 chromosome 20, complete, upper case (training chromosome; Debian vt-examples)",
            bases=63_025_520, n_bases=3_520_000,
        ),
        DataSourceSpec(
            name="grch37-chrX", target="megaseq_genome.sources:fetch",
            summary="human GRCh37 chromosome X, first 70 Mb, upper case (held-out chromosome; Debian smalt-examples)",
            bases=69_999_930, n_bases=3_760_000,
        ),
    ]


@hookimpl
def megaseq_baseline() -> list[BaselineSpec]:
    return [
        BaselineSpec(
            name="markov", target="megaseq_genome.markov:build", config=MarkovConfig,
            summary="order-k nucleotide Markov model fitted on data.train (add-1/2 smoothing)",
            # checkpoints of megaseq-core 0.1.0 hold the order in core's eval table
            replaces={"eval.markov_order": "order"},
        )
    ]


@hookimpl
def megaseq_eval_analysis() -> list[EvalAnalysisSpec]:
    return [
        EvalAnalysisSpec(
            name="retrieval", target="megaseq_genome.retrieval:build", config=RetrievalConfig,
            summary="bits/base by distance to the last earlier occurrence of each target's k-mer, and the share of "
            "a perfect copier's gain captured",
        )
    ]


@hookimpl
def megaseq_data_transform() -> list[DataTransformSpec]:
    return [
        DataTransformSpec(
            name="reverse-complement", target="megaseq_genome.transforms:build_reverse_complement",
            config=ReverseComplementConfig, changes_distribution=False,
            summary="with probability p, a training window replaced by its reverse complement (the other strand)",
        ),
        DataTransformSpec(
            name="planted-repeats", target="megaseq_genome.transforms:build_planted_repeats",
            config=PlantedRepeatsConfig, changes_distribution=True,
            summary="in a share of the training windows, a random segment copied at least its length further on "
            "(optionally annealed to none by a step)",
        ),
    ]


@hookimpl
def megaseq_command() -> list[CommandSpec]:
    return [
        CommandSpec(
            name="context-extension", target="megaseq_genome.experiment.cli:main",
            summary="does training at long context teach the model to use it? (trains and compares several models)",
        )
    ]
