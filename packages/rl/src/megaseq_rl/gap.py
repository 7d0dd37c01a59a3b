"""The trainer/engine log-probability gap (the reported run's correctness check).

For each prompt length L: ``prompts`` held-out DNA windows of L bases (windows without N of the policy's
held-out chromosome: the middle one, or evenly spaced ones) are the prompts, one batch; the engine continues it greedily for ``new_tokens`` tokens and reports
the log-probability of each; the training forward (``megaseq.inference.sequence_logprobs``: fp32 weights,
bf16 autocast when ``dtype = "bf16"``, as in training) re-scores the same tokens. Reported per length: mean
and max |delta logprob| over the generated tokens of every prompt. For a model with MoE layers the training forward runs
twice, replaying the engine's routing (R3) and routing by itself, so the effect of routing replay is
measured on the same tokens; ``mean_abs``/``max_abs`` are those of the mode asked for, and
``routing_mismatch`` is the fraction of (token, MoE layer) choices on which the two forwards disagree.
"""

from __future__ import annotations

from typing import Any

import torch

from megaseq.contracts import ForwardContext, RoutingReplay
from megaseq.data.sources import Corpus, tokenized
from megaseq.data.windows import GenomeWindows
from megaseq.devices import pick_device
from megaseq.errors import UserError
from megaseq.inference import SamplingParams, sequence_logprobs
from megaseq.plugins import Plugins
from megaseq_rl.policy import load_policy
from megaseq_rl.task import task_corpus


def heldout_prompts(corpus: Corpus, length: int, count: int) -> torch.Tensor:
    """``count`` windows of ``length`` bases without N, evenly spaced over ``corpus`` (the middle one for 1)."""
    windows = GenomeWindows(tokenized(corpus), length, max_n_fraction=0.0)
    if len(windows) < count:
        raise UserError(f"--lengths/--prompts: {str(corpus)!r} has {len(windows)} windows of {length} bases without N, {count} asked for")
    picks = [len(windows) // 2] if count == 1 else torch.linspace(0, len(windows) - 1, count).round().long().tolist()
    return windows.batch(picks).inputs


def routing_mismatch(engine: dict[str, torch.Tensor], trainer: dict[str, torch.Tensor]) -> float:
    """Fraction of (token, MoE layer) pairs whose set of experts differs between the engine and a training
    forward that routed by itself."""
    differ, total = 0, 0
    for key, chosen in engine.items():
        own = trainer[key].view_as(chosen).to(chosen.device)
        differ += int((chosen.sort(-1).values != own.sort(-1).values).any(-1).sum())
        total += chosen.shape[0] * chosen.shape[1]
    return differ / max(total, 1)


def measure_gap(
    checkpoint: str,
    lengths: list[int],
    plugins: Plugins,
    *,
    engine: str = "cached",
    dtype: str = "fp32",
    new_tokens: int = 32,
    device: str = "auto",
    routing_replay: bool = True,
    dataset: str | None = None,
    prompts: int = 1,
) -> list[dict[str, Any]]:
    _, recipe, model = load_policy(checkpoint, plugins)
    torch_device = pick_device(device)
    model.to(torch_device).eval()
    provided = plugins.get("inference_engine", engine, where="--engine")
    fields = provided.spec.config.model_fields
    options = {"dtype": dtype, "device": device, "max_model_len": max(lengths) + new_tokens}
    config = provided.spec.config(**{k: v for k, v in options.items() if k in fields})
    served = provided.load()(config, recipe, plugins)
    served.update_weights(model.state_dict())
    has_moe = recipe.model.moe is not None
    corpus = task_corpus(recipe, "heldout", dataset, plugins)
    rows = []
    for length in lengths:
        prompt = heldout_prompts(corpus, length, prompts)
        gen = served.generate(prompt, SamplingParams(new_tokens, temperature=0.0))
        tokens = torch.cat([prompt, gen.tokens.cpu()], 1).to(torch_device)
        engine_lp = gen.logprobs.to(torch_device)
        mask = gen.mask.to(torch_device)
        modes = [True, False] if has_moe else [False]
        row: dict[str, Any] = {"length": length, "prompts": prompts, "new_tokens": new_tokens, "dtype": dtype, "engine": engine,
                               "routing_replay": routing_replay and has_moe}
        for replay in modes:
            ctx = ForwardContext(routing=gen.replay() if replay else RoutingReplay("record"))
            with torch.no_grad(), torch.autocast(torch_device.type, dtype=torch.bfloat16, enabled=dtype == "bf16"):
                trainer_lp = sequence_logprobs(model, tokens, ctx, 1.0, recipe.train.loss_chunk)[:, length - 1 :]
            delta = (trainer_lp.float() - engine_lp).abs()[mask]
            stats = {"mean_abs": float(delta.mean()), "max_abs": float(delta.max())}
            if replay == row["routing_replay"]:
                row.update(stats)
            if has_moe:
                row.update({f"{'with' if replay else 'without'}_replay_{k}": v for k, v in stats.items()})
            if has_moe and not replay:
                row["routing_mismatch"] = routing_mismatch(gen.routing, ctx.routing.indices)
        rows.append(row)
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    moe = "with_replay_mean_abs" in rows[0]
    head = f"{'length':>9} {'dtype':>5} {'mean |d|':>10} {'max |d|':>10}"
    if moe:
        head += f" {'mean, R3':>10} {'mean, no R3':>12} {'routing differs':>16}"
    lines = [head]
    for r in rows:
        line = f"{r['length']:>9} {r['dtype']:>5} {r['mean_abs']:>10.2e} {r['max_abs']:>10.2e}"
        if moe:
            line += f" {r['with_replay_mean_abs']:>10.2e} {r['without_replay_mean_abs']:>12.2e} {r['routing_mismatch']:>16.2%}"
        lines.append(line)
    return "\n".join(lines)
