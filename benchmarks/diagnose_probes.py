"""Measurements behind the default recipe's settings and the context-extension diagnosis (docs/results.md).

    .venv/bin/python benchmarks/diagnose_probes.py gate                  # KDA forget gate at initialisation
    .venv/bin/python benchmarks/diagnose_probes.py residual --steps 8     # what each block writes, step by step
    .venv/bin/python benchmarks/diagnose_probes.py residual --set train.lr=1e-3
    .venv/bin/python benchmarks/diagnose_probes.py markov-data           # Markov baselines by training tokens
    .venv/bin/python benchmarks/diagnose_probes.py heldout --windows 24  # Markov baselines on the fixed held-out set, by position and by retrieval distance
    .venv/bin/python benchmarks/diagnose_probes.py repeats --windows 24  # what copying could gain past 4k there
    .venv/bin/python benchmarks/diagnose_probes.py indexer --run OUT/long --windows 4  # does DSA select and weigh the copy?
    .venv/bin/python benchmarks/diagnose_probes.py copy --run OUT/pretrain --windows 8  # planted repeats by distance
    .venv/bin/python benchmarks/diagnose_probes.py copy-train --set data.seq_len=4096 --steps 300 --plant 1.0 --segment 2048
    .venv/bin/python benchmarks/diagnose_probes.py copy-train --synthetic --set data.seq_len=512 --set train.batch_size=8 \
        --steps 1200 --plant 1.0 --segment 128 --distances 32 128 512
    .venv/bin/python benchmarks/diagnose_probes.py copy-train --synthetic --set data.seq_len=512 --set train.batch_size=8 \
        --steps 5500 --plant 1.0 --segment 256 --windows-until 128:2500 256:3500  # a window-length curriculum
    .venv/bin/python benchmarks/diagnose_probes.py copy-train --set data.seq_len=1024 --set train.batch_size=4 \
        --steps 1500 --plant 1.0 --windows-until 128:1000 256:1250 --retrieval  # and the natural repeats

``residual`` trains the recipe (1024-base windows, 2 per step) and after chosen steps runs 4 fixed chr20
windows through it, printing for the embedding, every attention and feed-forward output and the residual
stream after each block: the norm of the mean over tokens (what every token gets alike) / the mean norm of
the per-token deviation from it (what tells tokens apart). ``markov-data`` fits Markov baselines on the first
N tokens of shuffled chr20 training windows and scores them on 64 held-out chrX windows: what counting k-mers
reaches with the data a model has seen. ``heldout`` scores the order-8 and order-11 baselines on the
context-extension experiment's fixed held-out set (the ``cpu`` preset's, with ``--windows`` windows) with the
experiment's own scorers: bits/base per bucket with its 95% bootstrap interval, whether each curve is
flat within its intervals (how many windows it takes to resolve a given effect), and the retrieval table of
the experiment's report for each k (``megaseq_genome.retrieval``: the baselines and the perfect copier by
distance to each target's last earlier k-mer occurrence). ``repeats`` bounds what
long context can give on that set: for each target past ``short_len`` of context, whether the 20 tokens
before it occurred earlier in the window, the most recent such occurrence ending within ``short_len`` tokens
or only further back, and whether the token after that occurrence is the target (a copy would be right).

``indexer`` and ``copy`` diagnose retrieval in a trained run directory (``--run``, e.g. a context-extension
stage). ``indexer`` runs held-out windows through the model and, at every target whose preceding k-mer
occurred earlier in the window (``megaseq_genome.retrieval``), asks each DSA layer whether the key right after
that occurrence (what a copy reads) is among the indexer's selected keys (recall, beside chance: selected over
visible keys), what weight the sparse softmax gives it, and, for a sample of targets, what weight full causal
attention would give it: a missed copy is the indexer's when dense attention weighs the key and the selection
drops it, the main attention's when neither weighs it. ``copy`` plants repeats in real held-out DNA: after 512
bases, a segment is copied d bases further on; a model that copies predicts the copy's bases (from offset
``--skip``, once the preceding k-mer matches) better than the same bases at the original. It prints the bits
on the copy against the original for the model, for the model with each attention kind's output zeroed (which
layers copy), and for the order-11 Markov baseline (a control: it cannot copy). ``copy-train`` asks whether the
recipe's model learns to copy when the training data asks for it: it trains the recipe with a repeat planted
in a share (``--plant``) of the training windows (megaseq-genome's ``planted-repeats`` data transform: a random
segment of 32 to ``--segment`` bases copied at least its length further on) and prints the ``copy`` table after
chosen steps. With ``--synthetic`` the training windows are i.i.d. uniform bases, so that the planted copies are
all there is to learn, and the table is also printed on uniform bases; this replaces the data rather than
transforming it, so it stays an option of this probe. ``--windows-until W:S ...`` is a window-length curriculum
(core's ``data.schedule``): until step S, each training window of ``data.seq_len`` bases is cut into windows of
W bases (the same tokens per step, more rows), each planted on its own; after the last S, windows are whole. ``--retrieval`` adds, after the last step, the
retrieval table of the held-out windows' own (natural) repeats, each window cut into windows of
``data.seq_len`` bases: does copying learned on planted repeats reach the genome's repeats, which the Markov
baselines partly know?
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]


def probe_gate(args: argparse.Namespace) -> None:
    from megaseq.records import ModelDims
    from megaseq_kda.config import KDAConfig
    from megaseq_kda.layer import build

    print(f"{'gate':9} {'g: 1%':>10} {'25%':>10} {'50%':>10} {'75%':>10} {'99%':>10} {'|dg/d dt_bias| 10%':>19} {'50%':>9}")
    for gate in ("bounded", "softplus"):
        torch.manual_seed(0)
        layer = build(KDAConfig(n_heads=2, head_dim=64, gate=gate), ModelDims(d_model=128, n_layers=4, vocab_size=5), 0)
        g = layer.forget_gate(torch.randn(1, 512, 128))  # unit-scale input, as after the block's RMSNorm
        g.sum().backward()
        q = torch.quantile(g.detach().flatten(), torch.tensor([0.01, 0.25, 0.5, 0.75, 0.99])).tolist()
        grad = torch.quantile(layer.dt_bias.grad.abs(), torch.tensor([0.1, 0.5])).tolist()
        print(f"{gate:9} " + " ".join(f"{v:10.2e}" for v in q) + f" {grad[0]:19.1e} {grad[1]:9.1e}")


def _norms(v: torch.Tensor) -> str:
    v = v.reshape(-1, v.shape[-1]).float()
    mean = v.mean(0)
    return f"{mean.norm():.2f}/{(v - mean).norm(dim=-1).mean():.2f}"


def probe_residual(args: argparse.Namespace) -> None:
    from megaseq.config import load_recipe
    from megaseq.contracts import ForwardContext
    from megaseq.plugins import get_plugins
    from megaseq.train.trainer import Trainer

    plugins = get_plugins()
    sets = ["data.seq_len=1024", "train.batch_size=2", f"train.steps={args.steps}", "run.out_dir='runs/diagnose/residual'", *args.set]
    trainer = Trainer(load_recipe(args.recipe, plugins, sets), plugins, progress=False, tensorboard=False)
    model, outs = trainer.model, {}
    model.embed.register_forward_hook(lambda mod, a, o: outs.__setitem__("emb", o.detach()))
    for i, block in enumerate(model.blocks):
        block.attention.register_forward_hook(lambda mod, a, o, i=i: outs.__setitem__(f"attn{i}", o.detach()))
        block.ffn.register_forward_hook(lambda mod, a, o, i=i: outs.__setitem__(f"ffn{i}", o.detach()))
    batch = trainer.train_windows.batch([5, 500, 5000, 9000])

    def report(label: str) -> None:
        with torch.no_grad():
            model(batch.inputs, ForwardContext())
        residual, parts = outs["emb"], [f"emb {_norms(outs['emb'])}"]
        for i in range(len(model.blocks)):
            residual = residual + outs[f"attn{i}"] + outs[f"ffn{i}"]
            parts.append(f"attn{i} {_norms(outs[f'attn{i}'])} ffn{i} {_norms(outs[f'ffn{i}'])} R{i} {_norms(residual)}")
        print(f"{label:7} " + " | ".join(parts), flush=True)

    print("norm of the mean over tokens / mean norm of each token's deviation from it")
    report("init")
    for step in range(1, args.steps + 1):
        trainer.train_step()
        if step & (step - 1) == 0:  # powers of two
            report(f"step {step}")


def probe_markov_data(args: argparse.Namespace) -> None:
    from megaseq.data.sources import tokenized
    from megaseq.data.windows import GenomeWindows
    from megaseq_genome.markov import MarkovBaseline

    train = np.asarray(tokenized("grch37-chr20"))
    heldout = GenomeWindows(np.asarray(tokenized("grch37-chrX")[20_000_000:28_000_000]), 8192)
    batch = heldout.batch(np.linspace(0, len(heldout) - 1, 64).round().astype(int))
    windows = GenomeWindows(train, 8192)
    order = np.random.default_rng(0).permutation(len(windows))
    orders = [2, 4, 6, 8, 11]
    print(f"{'training tokens':>16} " + " ".join(f"{f'order {k}':>8}" for k in orders))
    for tokens in (614_400, 3_686_400, 14_000_000, 60_000_000):
        starts = np.sort(windows.starts[order[: min(len(order), tokens // 8192)]])
        data = np.concatenate([np.append(train[s : s + 8193], 4) for s in starts]).astype(np.uint8)  # N between windows
        bits = []
        for k in orders:
            losses = MarkovBaseline(k).fit(data).token_losses(batch.inputs, batch.targets)
            bits.append(float((losses * batch.weights.double()).sum() / batch.weights.sum() / np.log(2)))
        print(f"{len(starts) * 8192:16,} " + " ".join(f"{b:8.3f}" for b in bits), flush=True)


def probe_heldout(args: argparse.Namespace) -> None:
    from megaseq_genome.bootstrap import flat_within_intervals, mean_interval, resample_weights
    from megaseq_genome.experiment.report import columns, per_window_bits
    from megaseq_genome.heldout_set import score_windows
    from megaseq_genome.markov import fitted_markov
    from megaseq_genome.retrieval import RetrievalLoss, markdown, retrieval_table

    plan, heldout, tokens = _heldout(args)
    print(f"{plan.heldout} {list(plan.heldout_region)}: {heldout.candidates} windows of {plan.long_len + 1} without N, "
          f"{len(heldout.starts)} chosen; bits/base [95% interval]")
    weights = resample_weights(len(heldout.starts), plan.bootstrap_samples, seed=0)
    by_distance = {}
    for order in plan.markov_orders:
        by_distance[f"markov-{order}"] = RetrievalLoss(len(heldout.starts))
        acc = score_windows(heldout, tokens, plan.first_bucket, fitted_markov("grch37-chr20", order).token_losses,
                            by_distance[f"markov-{order}"])
        ci = mean_interval(per_window_bits(acc.sums, acc.edges, plan.short_len), weights, plan.confidence)
        n = len(acc.edges) - 1
        print(f"order {order}: flat within its intervals: {flat_within_intervals(ci['low'][:n], ci['high'][:n])}")
        for c, name in enumerate(columns(acc.edges, plan.short_len)):
            print(f"  {name:>8} {ci['mean'][c]:.4f} [{ci['low'][c]:.4f}, {ci['high'][c]:.4f}]")
    table = retrieval_table(by_distance, f"markov-{max(plan.markov_orders)}", weights, plan.confidence)
    for k in table["ks"]:
        print()
        print(markdown(table, k), end="")


def probe_repeats(args: argparse.Namespace) -> None:

    plan, heldout, tokens = _heldout(args)
    k, near = args.kmer, plan.short_len
    counts = {"targets": 0, "near": 0, "near_right": 0, "far": 0, "far_right": 0}
    for inputs, targets in heldout.windows(tokens):
        ids, nxt = inputs[0].numpy().astype(np.int64), targets[0].numpy()
        # the k-mer ending at each position, 2 bits a base (held-out windows hold no N)
        kmer = np.zeros(len(ids) - k + 1, dtype=np.int64)
        for j in range(k):
            kmer = (kmer << 2) | ids[j : len(ids) - k + 1 + j]
        end = np.arange(k - 1, len(ids))
        order = np.argsort(kmer, kind="stable")  # equal k-mers in position order: each one's predecessor
        same = kmer[order[1:]] == kmer[order[:-1]]
        previous = np.full(len(kmer), -1)
        previous[order[1:][same]] = end[order[:-1][same]]
        prev = np.full(len(ids), -1)
        prev[end] = previous
        p = np.arange(near, len(ids))  # targets with more than short_len tokens of context
        found, right = prev[p] >= 0, nxt[np.maximum(prev[p], 0)] == nxt[p]
        inside = found & (p - prev[p] <= near - k)  # the occurrence and its next token inside the last short_len
        counts["targets"] += len(p)
        counts["near"] += int(inside.sum())
        counts["near_right"] += int((inside & right).sum())
        counts["far"] += int((found & ~inside).sum())
        counts["far_right"] += int((found & ~inside & right).sum())
    n = counts["targets"]
    print(f"{len(heldout.starts)} windows of {plan.long_len}; {n:,} targets past {near} tokens of context; {k}-mers")
    print(f"  most recent repeat within the last {near}: {counts['near'] / n:.3%} of targets, its next token right "
          f"for {counts['near_right'] / n:.3%}")
    print(f"  most recent repeat only further back:   {counts['far'] / n:.3%} of targets, its next token right "
          f"for {counts['far_right'] / n:.3%}")
    print(f"  a model that predicts the far repeats' next token perfectly and everything else as a {near}-token "
          f"model gains at most {counts['far_right'] / n:.2%} of those targets' loss (if they cost the mean)")


def _stage_model(run_dir: str) -> tuple[Any, Any]:
    """The recipe and model of a training run directory (an experiment stage), with its newest verified weights."""
    from megaseq.config import validate_recipe
    from megaseq.model import build_model
    from megaseq.plugins import get_plugins
    from megaseq.train import checkpoint
    from megaseq_genome.experiment.context_extension import load_newest

    found = checkpoint.newest_verified(Path(run_dir) / "checkpoints")
    if found.path is None:
        raise SystemExit(f"{run_dir}: no verified checkpoint")
    recipe = validate_recipe(checkpoint.read_meta(found.path)["recipe"], get_plugins(), str(found.path))
    model = build_model(recipe, get_plugins()).eval()
    load_newest(Path(run_dir), model)
    print(f"{run_dir}: {found.path.name}, layers {[type(b.attention).__name__ for b in model.blocks]}")
    return recipe, model


def _heldout(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """The experiment plan of ``--scale`` with ``--windows`` held-out windows, its fixed held-out set and tokens."""
    from megaseq.data.sources import tokenized
    from megaseq_genome.experiment.plan import load_plan
    from megaseq_genome.heldout_set import select_heldout

    plan = load_plan(args.scale, [f"plan.eval_windows={args.windows}"])
    tokens = tokenized(plan.heldout)
    return plan, select_heldout(tokens, plan.heldout, plan.heldout_region, plan.long_len, plan.eval_windows), tokens


def probe_indexer(args: argparse.Namespace) -> None:
    import dataclasses

    import megaseq_dsa.layer as dsa_layer
    from megaseq.contracts import ForwardContext
    from megaseq_genome.retrieval import BUCKETS, bucket_of, last_occurrence

    _, model = _stage_model(args.run)
    dsa = [i for i, b in enumerate(model.blocks) if isinstance(b.attention, dsa_layer.DeepSeekSparseAttention)]
    if not dsa:
        raise SystemExit(f"{args.run}: the model has no DSA layer")
    calls: list[tuple] = []  # (q, key, indices, scale) of each DSA layer's sparse attention, in layer order
    backends = dsa_layer.BACKENDS

    class Recording:  # the layer's backend, with the sparse attention's inputs recorded
        def load(self, name: str, device: Any) -> Any:
            ops = backends.load(name, device)

            def attend(q, key, value, indices, scale, chunk):  # type: ignore[no-untyped-def]
                calls.append((q, key, indices, scale))
                return ops.sparse_attention(q, key, value, indices, scale, chunk)

            return dataclasses.replace(ops, sparse_attention=attend)

        def __getattr__(self, name: str) -> Any:
            return getattr(backends, name)

    dsa_layer.BACKENDS = Recording()
    _, heldout, tokens = _heldout(args)
    n = len(BUCKETS)
    names = ("targets", "recall_next", "recall_span", "chance", "weight_mean", "weight_max", "dense_n", "dense_mean", "dense_max")
    stats = {i: {name: np.zeros(n) for name in names} for i in dsa}
    rng = np.random.default_rng(0)
    for w, (inputs, targets) in enumerate(heldout.windows(tokens)):
        calls.clear()
        with torch.no_grad():
            model(inputs, ForwardContext())
        ids = np.concatenate([inputs[0].numpy(), targets[0, -1:].numpy()])
        distance, _ = last_occurrence(ids, args.kmer)
        p = np.flatnonzero(distance > 0)  # queries whose k-mer occurred earlier
        src = p - distance[p] + 1  # the key after the earlier occurrence: what a copy reads
        bucket = bucket_of(distance[p])
        dense = np.zeros(len(p), dtype=bool)
        for b in range(n):  # a sample per bucket gets the dense softmax too: would full attention copy?
            members = np.flatnonzero(bucket == b)
            dense[rng.choice(members, min(len(members), args.dense_sample), replace=False)] = True
        for layer, (q, key, indices, scale) in zip(dsa, calls, strict=True):
            qp = torch.from_numpy(p)
            sel = indices[0, qp].long()  # [P, slots], -1 padded
            valid = sel >= 0
            hit = (sel == torch.from_numpy(src)[:, None]) & valid
            lo = torch.from_numpy(src - args.kmer)[:, None]
            span = ((sel >= lo) & (sel <= torch.from_numpy(src)[:, None]) & valid).any(1)
            logits = torch.einsum("phd,psd->phs", q[0, qp].float(), key[0, sel.clamp(min=0)].float()) * scale
            probs = logits.masked_fill(~valid[:, None], float("-inf")).softmax(-1)
            weight = (probs * hit[:, None]).sum(-1)  # [P, H]
            s = stats[layer]
            np.add.at(s["targets"], bucket, 1)
            np.add.at(s["recall_next"], bucket, hit.any(1).numpy())
            np.add.at(s["recall_span"], bucket, span.numpy())
            np.add.at(s["chance"], bucket, np.minimum(1.0, valid.sum(1).numpy() / (p + 1)))
            np.add.at(s["weight_mean"], bucket, weight.mean(1).numpy())
            np.add.at(s["weight_max"], bucket, weight.max(1).values.numpy())
            for j in np.flatnonzero(dense):
                full = (torch.einsum("hd,sd->hs", q[0, p[j]].float(), key[0, : p[j] + 1].float()) * scale).softmax(-1)
                s["dense_n"][bucket[j]] += 1
                s["dense_mean"][bucket[j]] += float(full[:, src[j]].mean())
                s["dense_max"][bucket[j]] += float(full[:, src[j]].max())
        print(f"  window {w + 1}/{len(heldout.starts)}: {len(p):,} targets with an earlier {args.kmer}-mer", flush=True)
    print(f"\n{args.run}: DSA at targets whose preceding {args.kmer}-mer occurred earlier in the window, by distance")
    print("recall: the key after the earlier occurrence (or any key of it) is among the selected; chance: selected / "
          "visible keys; weight: the sparse softmax's weight on that key (0 when not selected), mean and max over "
          "heads; dense: the same weight under full causal attention (a sample of targets)")
    header = f"{'layer':>5} {'bucket':>8} {'targets':>9} {'recall':>7} {'any key':>8} {'chance':>7} {'weight':>7} {'max head':>8} {'dense':>7} {'max head':>8}"
    print(header)
    for layer in dsa:
        s = stats[layer]
        for b, name in enumerate(BUCKETS[:-1]):
            c, d = max(s["targets"][b], 1), max(s["dense_n"][b], 1)
            print(f"{layer:>5} {name:>8} {int(s['targets'][b]):>9,} {s['recall_next'][b] / c:7.3f} {s['recall_span'][b] / c:8.3f} "
                  f"{s['chance'][b] / c:7.3f} {s['weight_mean'][b] / c:7.4f} {s['weight_max'][b] / c:8.4f} "
                  f"{s['dense_mean'][b] / d:7.4f} {s['dense_max'][b] / d:8.4f}")


def _copy_table(recipe: Any, model: Any, windows: list[Any], args: argparse.Namespace, ablate: bool = True, markov: Any = None) -> None:
    """Print the planted-repeat table (module docstring, ``copy``) of ``model`` on held-out ``windows``."""
    from megaseq.contracts import ForwardContext
    from megaseq.model import chunked_token_losses

    pattern = [recipe.model.attention_of(i) for i in range(len(model.blocks))]  # each block's attention
    silenced: set[int] = set()  # blocks whose attention output is replaced by zeros
    hooks = [
        block.attention.register_forward_hook(lambda mod, a, out, i=i: torch.zeros_like(out) if i in silenced else out)
        for i, block in enumerate(model.blocks)
    ]
    kinds = sorted(set(pattern)) if ablate else []
    rows = [("model", set())] + [(f"without {kind}", {i for i, k in enumerate(pattern) if k == kind}) for kind in kinds if len(kinds) > 1]
    before, start = 512, args.skip
    print(f"planted repeats: {len(windows)} held-out windows; {before} bases, then a segment of S = min({args.segment}, d) "
          f"bases, copied d bases later; bits/base on the copy's bases from offset {start} on / the same bases at the "
          "original (a perfect copier: 0 on the copy); gain = 1 - copy / original")
    print(f"{'scorer':>12} " + " ".join(f"{f'd={d}':>17}" for d in args.distances))
    for label, off in [*rows, *([("markov-11", None)] if markov is not None else [])]:
        silenced.clear()
        silenced.update(off or ())
        cells = []
        for d in args.distances:
            seg = min(args.segment, d)
            orig = copy = 0.0
            for ids in windows:
                x = ids[: before + d + seg + 1].clone()
                x[before + d : before + d + seg] = x[before : before + seg]
                inputs, targets = x[None, :-1], x[None, 1:]
                if off is None:
                    loss = markov.token_losses(inputs, targets)[0]
                else:
                    with torch.no_grad():
                        hidden = model(inputs, ForwardContext())
                        loss = chunked_token_losses(hidden, model.head_weight, targets, recipe.train.loss_chunk)[0].double()
                # target t is x[t + 1]: the segment's bases from offset `start` on are targets [first + start - 1, first + seg - 1)
                orig += float(loss[before + start - 1 : before + seg - 1].sum())
                copy += float(loss[before + d + start - 1 : before + d + seg - 1].sum())
            count = len(windows) * (seg - start) * np.log(2)
            cells.append(f"{copy / count:5.3f}/{orig / count:5.3f} {1 - copy / orig:+5.0%}")
        print(f"{label:>12} " + " ".join(f"{c:>17}" for c in cells), flush=True)
    for hook in hooks:
        hook.remove()


def probe_copy(args: argparse.Namespace) -> None:
    from megaseq_genome.markov import fitted_markov

    recipe, model = _stage_model(args.run)
    _, heldout, tokens = _heldout(args)
    print()
    _copy_table(recipe, model, [inputs[0] for inputs, _ in heldout.windows(tokens)], args, markov=fitted_markov("grch37-chr20", 11))


def _window_stage(text: str) -> tuple[int, int]:
    """``W:S`` of ``--windows-until``: (S, W); the recipe checks W (a divisor of ``data.seq_len``, long enough for
    a planted segment and its copy)."""
    try:
        width, until = (int(part) for part in text.split(":"))
    except ValueError:
        raise SystemExit(f"--windows-until {text!r}: expected W:S, a window length and a step, e.g. 128:2500") from None
    if until < 1:
        raise SystemExit(f"--windows-until {text!r}: S must be at least 1")
    return until, width


def _natural_retrieval(recipe: Any, model: Any, held: list[Any], plan: Any) -> None:
    """Print the retrieval table (``megaseq_genome.retrieval``) of ``model`` on the natural repeats of the held-out
    windows ``held``, each cut into windows of the training length: does copying learned on planted repeats reach
    the genome's own repeats, against the Markov baselines (which know the repeat families)?"""
    from megaseq.contracts import ForwardContext
    from megaseq.model import chunked_token_losses
    from megaseq_genome.bootstrap import resample_weights
    from megaseq_genome.markov import fitted_markov
    from megaseq_genome.retrieval import RetrievalLoss, markdown, retrieval_table

    length = recipe.data.seq_len
    markov = {f"markov-{order}": fitted_markov("grch37-chr20", order) for order in plan.markov_orders}
    scores = {name: RetrievalLoss(len(held)) for name in ["model", *markov]}
    for w, ids in enumerate(held):
        starts = range(0, len(ids) - length, length)  # pieces of length + 1 tokens, as training windows are cut
        pieces = torch.stack([ids[s : s + length + 1] for s in starts])
        inputs, targets = pieces[:, :-1], pieces[:, 1:]
        with torch.no_grad():
            hidden = model(inputs, ForwardContext())
            losses = {"model": chunked_token_losses(hidden, model.head_weight, targets, recipe.train.loss_chunk).double()}
        losses |= {name: baseline.token_losses(inputs, targets) for name, baseline in markov.items()}
        for name, loss in losses.items():
            for piece, row in zip(pieces, loss, strict=True):  # every piece's sums go to its held-out window
                one = RetrievalLoss(1, scores[name].ks)
                one.add(0, piece.numpy(), row.numpy())
                for field in RetrievalLoss.FIELDS:
                    getattr(scores[name], field)[w] += getattr(one, field)[0]
    weights = resample_weights(len(held), plan.bootstrap_samples, seed=0)
    table = retrieval_table(scores, f"markov-{max(plan.markov_orders)}", weights, plan.confidence)
    print(f"\nnatural repeats: {len(held)} held-out windows cut into {length}-base windows; intervals over the "
          "held-out windows")
    for k in (12, 20):
        print()
        print(markdown(table, k), end="", flush=True)


def probe_copy_train(args: argparse.Namespace) -> None:
    from megaseq.config import load_recipe
    from megaseq.data.windows import Batch
    from megaseq.errors import UserError
    from megaseq.plugins import get_plugins
    from megaseq.train.trainer import Trainer

    plugins = get_plugins()
    schedule = sorted(_window_stage(text) for text in args.windows_until)  # (until step, W)
    stages = ", ".join(f"{{seq_len = {width}, until_step = {until}}}" for until, width in schedule)
    sets = [f"train.steps={args.steps}", "run.out_dir='runs/diagnose/copy-train'", 'data.transforms=["planted-repeats"]',
            f"data_transform.planted-repeats.share={args.plant}", f"data_transform.planted-repeats.segment={args.segment}",
            *([f"data.schedule=[{stages}]"] if schedule else []), *args.set]
    try:
        trainer = Trainer(load_recipe(args.recipe, plugins, sets), plugins, progress=False, tensorboard=False)
    except UserError as exc:
        raise SystemExit(f"copy-train: {exc}") from None
    if args.synthetic:
        windows, rng = trainer.train_windows, np.random.default_rng(0)

        class Uniform:  # the training windows' shapes, i.i.d. uniform bases: only the planted copies can be predicted
            def __len__(self) -> int:
                return len(windows)

            def batch(self, indices: Any) -> Batch:
                out = windows.batch(indices)
                ids = torch.from_numpy(rng.integers(0, 4, (len(out.inputs), out.inputs.shape[1] + 1))).to(out.inputs.dtype)
                return Batch(ids[:, :-1].clone(), ids[:, 1:].clone(), torch.ones_like(out.weights))

        trainer.train_windows = Uniform()
    plan, heldout, tokens = _heldout(args)
    held = [inputs[0] for inputs, _ in heldout.windows(tokens)]
    uniform = [torch.from_numpy(np.random.default_rng(1).integers(0, 4, len(ids))).to(ids.dtype) for ids in held]
    print(f"training {args.recipe} ({' '.join(sets)}) with a planted repeat in {args.plant:.0%} of the "
          f"{'i.i.d. uniform' if args.synthetic else 'training'} windows"
          + "".join(f"; {w}-base windows until step {until}" for until, w in schedule))
    for step in range(1, args.steps + 1):
        metrics = trainer.train_step()
        if step in args.report_at or step == args.steps:
            trainer.model.eval()
            print(f"\nstep {step}: loss {metrics['loss']:.4f}")
            _copy_table(trainer.recipe, trainer.model, held, args, ablate=step == args.steps)
            if args.synthetic:
                print("the same on i.i.d. uniform bases (the original bases: 2 bits/base to any model)")
                _copy_table(trainer.recipe, trainer.model, uniform, args, ablate=False)
            if args.retrieval and step == args.steps:
                _natural_retrieval(trainer.recipe, trainer.model, [torch.cat([i[0], t[0, -1:]]) for i, t in heldout.windows(tokens)], plan)
            trainer.model.train()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("probe", choices=["gate", "residual", "markov-data", "heldout", "repeats", "indexer", "copy", "copy-train"])
    p.add_argument("--run", help="a trained run directory, e.g. an experiment's OUT/pretrain (indexer, copy)")
    p.add_argument("--dense-sample", type=int, default=200, help="targets per bucket scored under full attention too (indexer)")
    p.add_argument("--distances", type=int, nargs="+", default=[32, 128, 512, 2048, 8192, 32768], help="copy distances (copy)")
    p.add_argument("--segment", type=int, default=256, help="longest planted segment (copy)")
    p.add_argument("--skip", type=int, default=20, help="segment offset from which copied bases are scored (copy)")
    p.add_argument("--plant", type=float, default=0.5, help="share of training windows given a planted repeat (copy-train)")
    p.add_argument("--synthetic", action="store_true",
                   help="train on i.i.d. uniform bases instead of the genome, so that copies are all there is to learn (copy-train)")
    p.add_argument("--windows-until", nargs="+", default=[], metavar="W:S",
                   help="train in W-base windows until step S, a window-length curriculum (copy-train)")
    p.add_argument("--retrieval", action="store_true",
                   help="after the last step, also print the retrieval table on the held-out windows' natural repeats (copy-train)")
    p.add_argument("--report-at", type=int, nargs="+", default=[], help="steps after which to print the copy table (copy-train)")
    p.add_argument("--recipe", default=str(REPO / "recipes" / "genome-cpu.toml"))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--set", action="append", default=[], help="recipe override (residual)")
    p.add_argument("--scale", default="cpu", help="experiment preset whose held-out set is scored (heldout)")
    p.add_argument("--windows", type=int, default=24, help="held-out windows (heldout, repeats)")
    p.add_argument("--kmer", type=int, default=20, help="repeat length (repeats)")
    args = p.parse_args()
    probes = {"gate": probe_gate, "residual": probe_residual, "markov-data": probe_markov_data, "heldout": probe_heldout,
              "repeats": probe_repeats, "indexer": probe_indexer, "copy": probe_copy,
              "copy-train": probe_copy_train}
    probes[args.probe](args)


if __name__ == "__main__":
    main()
