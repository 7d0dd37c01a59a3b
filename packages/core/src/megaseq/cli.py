"""The ``megaseq`` command line. User mistakes: one line on stderr, exit status 2, no traceback."""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import warnings
from pathlib import Path
from typing import Any

from megaseq import threads
from megaseq.__about__ import __version__
from megaseq.catalog import PROVIDERS
from megaseq.errors import UserError


def _one_line_warnings() -> None:
    def show(message, category, filename, lineno, file=None, line=None):
        print(f"megaseq: warning: {message}", file=sys.stderr)

    warnings.showwarning = show


def cmd_train(args: argparse.Namespace) -> int:
    from megaseq.config import ParallelConfig, load_recipe
    from megaseq.distributed.launch import in_torchrun
    from megaseq.distributed.layout import Layout, resolve_layout
    from megaseq.plugins import get_plugins

    plugins = get_plugins()
    init_from = [f"train.init_from={json.dumps(args.init_from)}"] if args.init_from else []
    out = [f"run.out_dir={json.dumps(args.out)}"] if args.out else []  # TOML reads a JSON string as a string
    recipe = load_recipe(args.recipe, plugins, [*args.set, *out, *memory_policy_override(args.memory_policy), *init_from])
    layout = resolve_layout(recipe, Layout.parse(args.parallel, base=Layout.of(recipe)), args.workers)
    parallel = {name: getattr(layout, name) for name in ParallelConfig.model_fields}
    recipe = recipe.model_copy(update={"parallel": ParallelConfig(**parallel)})
    if args.dry_run:
        from megaseq.distributed.launch import dry_run

        print(dry_run(recipe, plugins, layout, args.resume, args.address))
        return 0
    mode = "resume" if args.resume else "overwrite" if args.overwrite else "new"
    from megaseq.distributed.launch import WorkerFailed, preflight, run_torchrun, run_with_ray
    from megaseq.eval.evaluate import check_analyses
    from megaseq.train import rundir

    if in_torchrun():  # rank 0's trainer holds the lock; the launching process checked the analyses
        preflight(recipe, plugins, layout, args.resume, args.address)
        result = run_torchrun(recipe, mode, progress=not args.no_progress)
        if result is not None:
            print_eval(result.out_dir, result.step)
        return 0
    # the lock first: a second trainer of a live run stops at once, before baselines are fitted or a model built;
    # held here for the whole run (and, under Ray, for the workers over their restarts)
    with rundir.RunLock(recipe.out_dir, "training"):
        check_analyses(recipe, plugins)
        if layout.world_size == 1 and args.address is None:
            from megaseq.train.trainer import Trainer

            result = Trainer(recipe, plugins, progress=not args.no_progress, lock_run=False).run(mode)
            out_dir, step = result.out_dir, result.step
        else:
            preflight(recipe, plugins, layout, args.resume, args.address)
            rundir.prepare(recipe.out_dir, mode)  # once, here: restarted workers must not refuse or wipe their own run
            try:
                out_dir, step = run_with_ray(recipe, layout, args.resume, args.address, args.max_failures), recipe.train.steps
            except WorkerFailed as exc:
                print(f"megaseq: error: {exc}", file=sys.stderr)
                return 1
    print_eval(out_dir, step)
    return 0


def print_eval(out_dir: Path, step: int) -> None:
    """The held-out table the run wrote for its final step (rank 0 of a distributed run writes it)."""
    from megaseq.eval.evaluate import analysis_tables
    from megaseq.eval.positions import format_table
    from megaseq.train.rundir import eval_dir

    where = eval_dir(out_dir, step)
    heldout = json.loads((where / "heldout.json").read_text())
    print(f"\nheld-out {heldout['heldout']}, {heldout['windows']} windows of {heldout['seq_len']} bases "
          f"(bits/base by context position):")
    print(format_table(heldout["results"]) + analysis_tables(heldout.get("analyses", {})))
    print(f"\nwrote {where}/heldout.json, heldout_by_position.png; checkpoints in {out_dir}/checkpoints")


def memory_policy_override(value: str | None) -> list[str]:
    """``--memory-policy auto|none|NAMES`` as a recipe override of ``train.memory_policy``."""
    if value is None:
        return []
    parsed = parse_policy_argument(value)
    return [f"train.memory_policy={json.dumps([] if parsed == 'none' else parsed)}"]


def parse_policy_argument(value: str) -> str | list[str]:
    """``auto``, ``none`` or comma-separated policy names."""
    value = value.strip()
    if value in ("auto", "none"):
        return value
    names = [n.strip() for n in value.split(",") if n.strip()]
    if not names or any(not re.fullmatch(r"[A-Za-z0-9_.-]+", n) for n in names):
        raise UserError(f"--memory-policy {value!r}: expected auto, none or comma-separated policy names")
    return names


def cmd_plan(args: argparse.Namespace) -> int:
    from megaseq.config import load_recipe
    from megaseq.devices import device_type
    from megaseq.distributed.layout import Layout
    from megaseq.memory.machine import Machine
    from megaseq.memory.plan import plan
    from megaseq.memory.plan_report import plan_json, render_table
    from megaseq.plugins import get_plugins

    policies = parse_policy_argument(args.memory_policy)
    plugins = get_plugins()
    overrides = list(args.set)
    if isinstance(policies, list):
        overrides += memory_policy_override(args.memory_policy)
    recipe = load_recipe(args.recipe, plugins, overrides)
    # the recipe's [parallel] layout, with --parallel's dimensions on top
    layout = Layout.parse(args.parallel, base=Layout.of(recipe))
    machine = Machine.detect(device_type(recipe.run.device), args.device_mem, args.host_mem)
    seq_len = None if args.seq_len is None else seq_len_argument(args.seq_len)
    result = plan(recipe, plugins, seq_len=seq_len, layout=layout, machine=machine, policies=policies)
    print(json.dumps(plan_json(result), indent=2) if args.json else render_table(result))
    return 0


def seq_len_argument(value: str) -> int:
    """``--seq-len`` read and checked as ``--set data.seq_len=VALUE`` is (so ``1e6`` works in both)."""
    from pydantic import ValidationError

    from megaseq.config import DataConfig, parse_override

    _, parsed = parse_override(f"data.seq_len={value}")
    try:
        return DataConfig(seq_len=parsed).seq_len
    except ValidationError as exc:
        raise UserError(f"--seq-len {value}: {exc.errors()[0]['msg']}") from None


def cmd_eval(args: argparse.Namespace) -> int:
    import torch

    from megaseq.config import apply_overrides, validate_recipe
    from megaseq.devices import pick_device
    from megaseq.distributed.sharded import read_full_weights
    from megaseq.eval.evaluate import evaluate_heldout
    from megaseq.model import build_model
    from megaseq.plugins import get_plugins
    from megaseq.train import checkpoint, rundir

    path = checkpoint.resolve(Path(args.checkpoint))
    meta = checkpoint.read_meta(path)
    out = Path(args.out) if args.out else default_eval_dir(path)
    # writing into the checkpoint's run directory: under its lock, so never beside a trainer writing it
    run_dir = path.parent.parent if path.parent.name == "checkpoints" else None
    into_run = run_dir is not None and out.absolute().is_relative_to(run_dir.absolute())
    with rundir.RunLock(run_dir, "evaluation") if into_run else contextlib.nullcontext():
        rundir.check_writable(out, "eval --out" if args.out else "evaluation output")
        plugins = get_plugins()
        recipe = validate_recipe(apply_overrides(meta["recipe"], args.set), plugins, source=f"{path}/meta.json")
        device = pick_device(recipe.run.device)
        model = build_model(recipe, plugins).to(device)
        checkpoint.load_weights(path, model, read_full_weights(path, meta))  # checkpoints of any layout hold every expert
        print(f"evaluating {path} (step {meta['step']}) on {recipe.data.heldout}; writing {out}", file=sys.stderr)
        with torch.no_grad():
            result = evaluate_heldout(model, recipe, device, plugins, out_dir=out, baseline=not args.no_baseline, progress=not args.no_progress)
    print(f"step {meta['step']}: held-out {recipe.data.heldout}, {result['windows']} windows of {recipe.data.seq_len} bases")
    print(result["table"])
    extra = ", heldout_by_position.png and the analyses' files" if result["analyses"] else " and heldout_by_position.png"
    print(f"wrote {out}/heldout.json{extra}")
    return 0


def default_eval_dir(checkpoint_dir: Path) -> Path:
    """``RUN/eval/step_N`` for a checkpoint inside ``RUN/checkpoints``, else ``<checkpoint>-eval`` beside it:
    never inside the checkpoint, whose files its manifest describes."""
    if checkpoint_dir.parent.name == "checkpoints":
        return checkpoint_dir.parent.parent / "eval" / checkpoint_dir.name
    return checkpoint_dir.with_name(checkpoint_dir.name + "-eval")


def cmd_import(args: argparse.Namespace) -> int:
    from megaseq.interop.convert import import_model
    from megaseq.plugins import get_plugins

    path = import_model(Path(args.model), Path(args.out), get_plugins())
    print(f"wrote {args.out}/recipe.toml and the checkpoint {path}")
    print(f"fine-tune: megaseq train {args.out}/recipe.toml --init-from {args.out}; evaluate: megaseq eval {args.out}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from megaseq.interop.convert import export_checkpoint
    from megaseq.plugins import get_plugins

    files = export_checkpoint(Path(args.checkpoint), Path(args.out), args.layout, get_plugins(), int(args.max_shard_gib * 2**30))
    print(f"wrote {args.out}: {', '.join(files)}")
    return 0


def cmd_checkpoint_upgrade(args: argparse.Namespace) -> int:
    from megaseq.train import checkpoint

    path = Path(args.path)
    upgraded = checkpoint.upgrade(path)
    for target in upgraded:
        print(f"wrote {target / checkpoint.MANIFEST}")
    if not upgraded:
        print(f"{path}: every checkpoint already has a manifest")
    return 0


def cmd_plugins(args: argparse.Namespace) -> int:
    from megaseq import plugin_report
    from megaseq.plugins import get_plugins

    return plugin_report.run(get_plugins(), as_json=args.json, check=args.check)


def cmd_data_fetch(args: argparse.Namespace) -> int:
    from megaseq.data.sources import fetch, token_metadata
    from megaseq.plugins import get_plugins

    plugins = get_plugins()
    cache_dir = Path(args.cache_dir) if args.cache_dir else None
    path = fetch(args.name, cache_dir, plugins)
    meta = token_metadata(args.name, cache_dir, plugins)
    print(f"{args.name}: {path}")
    print(json.dumps({k: v for k, v in meta.items() if k != "records"}, indent=2))
    return 0


def cmd_data_list(args: argparse.Namespace) -> int:
    from megaseq.data.sources import data_sources

    for name, provided in sorted(data_sources().items()):
        print(f"{name}: {provided.spec.summary} [{provided.plugin.label}]")
    return 0


TRAIN_HELP = """Train the model a TOML recipe describes.

Output goes to the run directory, run.out_dir (default runs/{run.name}; set it with --set
run.out_dir=PATH): metrics.jsonl, tensorboard/, checkpoints/ (train.checkpoint_every, the newest
train.keep_checkpoints kept) and eval/step_N/ (held-out loss by context position of the final
step, JSON and PNG; where megaseq eval writes too).

A run directory holds one run: training into one that already holds output is an error unless you pass
--resume (continue from its newest good checkpoint; the logs are cut back to that step) or --overwrite
(delete its output and start over). Ctrl-C or SIGTERM saves a checkpoint after the current step; a second
one stops at once.

data.train and data.heldout are dataset names (megaseq data list) or paths to FASTA files (plain or
gzip), e.g. --set data.train=/path/genome.fa.gz."""

EVAL_HELP = """Held-out loss by context position of a checkpoint, beside the baselines its recipe names
(eval.baselines; --set 'eval.baselines=["markov"]' adds one), and the analyses it names (eval.analyses, e.g.
megaseq-genome's retrieval table: --set 'eval.analyses=["retrieval"]').

Writes heldout.json, heldout_by_position.png and the analyses' plots to --out, by default RUN/eval/step_N for a checkpoint in
RUN/checkpoints (never into the checkpoint directory itself)."""


CORE_COMMANDS = ("train", "eval", "plugins", "data", "plan", "import", "export", "checkpoint")
# Commands of this repository's plugin packages, by name only (core imports no plugin): without the package
# installed, asking for one says what to install instead of argparse's "invalid choice".
PACKAGED_COMMANDS = {name: dist for (kind, name), dist in PROVIDERS.items() if kind == "command"}


def plugin_commands(name: str | None = None) -> dict[str, Any]:
    """``{name: Provided}`` of the commands installed plugins add (hook ``megaseq_command``). A plugin command
    named like a core command is never dispatched: warned about here, core's own command runs. Asking for
    ``name`` when two plugins provide it is a one-line error naming both."""
    from megaseq.plugins import get_plugins

    plugins = get_plugins()
    if name is not None and ("command", name) in plugins.conflicts:
        plugins.get("command", name)  # raises the conflict's one-line error
    commands = dict(plugins.registry["command"])
    for name in CORE_COMMANDS:
        if name in commands:
            warnings.warn(f"command {name!r} from {commands.pop(name).plugin.label} is ignored: core's own {name!r} runs", stacklevel=2)
    return commands


def run_plugin_command(provided: Any, argv: list[str]) -> int:
    main_fn = provided.load()
    status = main_fn(argv)
    return 0 if status is None else int(status)


def parser(commands: dict[str, Any] | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megaseq", description="Plugin-based training for million-token sequences.")
    p.add_argument("--version", action="version", version=f"megaseq-core {__version__}")
    sub = p.add_subparsers(title="commands", metavar="COMMAND")
    p.set_defaults(func=missing_command("megaseq", sub))

    t = sub.add_parser("train", help="train a recipe", description=TRAIN_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("recipe", help="path to a TOML recipe, e.g. recipes/genome-cpu.toml")
    t.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE", help="override a recipe value")
    start = t.add_mutually_exclusive_group()
    start.add_argument("--resume", action="store_true", help="continue from the newest good checkpoint in the run directory")
    start.add_argument("--overwrite", action="store_true", help="delete the run directory's output and start over")
    t.add_argument("--out", metavar="DIR", help="the run directory (as --set run.out_dir=DIR; default runs/{run.name})")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.add_argument("--parallel", metavar="dp=N,cp=N,tp=N,ep=N,etp=N", help="process layout (overrides the recipe's "
                   "[parallel]): dp x cp x tp workers; ep x etp of them (dividing the workers) share each MoE layer's "
                   "experts, etp splitting each expert's hidden width")
    t.add_argument("--workers", type=int, metavar="N", help="start N workers with Ray Train (alone: dp=N)")
    t.add_argument("--address", metavar="HOST:PORT", help="run the workers on this existing Ray cluster")
    t.add_argument("--max-failures", type=int, default=2, metavar="K",
                   help="restarts of the worker group from the newest checkpoint after a worker dies (default 2)")
    t.add_argument("--memory-policy", metavar="auto|none|NAMES",
                   help="memory policies (train.memory_policy): auto = what `megaseq plan` proposes, none, or names")
    t.add_argument("--dry-run", action="store_true",
                   help="check the layout against the recipe and print every rank's groups and the memory plan, "
                   "then stop: no worker starts, no device is used")
    t.add_argument("--init-from", metavar="DIR",
                   help="start from these weights (train.init_from): a run directory, e.g. one `megaseq import` wrote, "
                   "or a checkpoint; the recipe's data and schedule apply")
    t.set_defaults(func=cmd_train)

    mp = sub.add_parser("plan", help="plan memory (policies, peak per device)",
                        description="Predict a recipe's peak memory per device under each memory-policy set and "
                        "propose the cheapest set that fits.")
    mp.add_argument("recipe", help="path to a TOML recipe")
    mp.add_argument("--seq-len", metavar="N", help="tokens per sequence, read as --set data.seq_len=N is (default: the recipe's)")
    mp.add_argument("--parallel", metavar="dp=..,cp=..,ep=..,tp=..,etp=..",
                    help="ranks per dimension, over the recipe's [parallel]")
    mp.add_argument("--device-mem", type=float, metavar="GiB", help="memory per device (default: this machine's RAM or GPU)")
    mp.add_argument("--host-mem", type=float, metavar="GiB", help="host memory per device for offloaded activations and the host optimizer state (default: unlimited)")
    mp.add_argument("--memory-policy", default="auto", metavar="auto|none|NAMES",
                    help="auto (default): every candidate set; none; or the names of the set to plan")
    mp.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE", help="override a recipe value")
    mp.add_argument("--json", action="store_true", help="one JSON object")
    mp.set_defaults(func=cmd_plan)

    e = sub.add_parser("eval", help="evaluate a checkpoint", description=EVAL_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("checkpoint", help="a checkpoint directory, or a run directory (its newest good checkpoint)")
    e.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE", help="e.g. eval.windows=128")
    e.add_argument("--out", metavar="DIR", help="where to write heldout.json and the plot (default: RUN/eval/step_N)")
    e.add_argument("--no-baseline", action="store_true", help="skip the recipe's baselines and analyses (eval.baselines, eval.analyses)")
    e.add_argument("--no-progress", action="store_true", help="no progress bars")
    e.set_defaults(func=cmd_eval)

    im = sub.add_parser("import", help="import a Hugging Face model (fla KDA, Kimi-Linear)",
                        description="Convert a Hugging Face model directory (config.json, safetensors, tokenizer.json) "
                        "of fla's KDA family or Kimi-Linear's layout into OUT/recipe.toml and a checkpoint in "
                        "OUT/checkpoints. Anything it cannot map exactly is one line, exit status 2, nothing written.")
    im.add_argument("model", help="the model directory")
    im.add_argument("--out", required=True, metavar="DIR", help="a new directory for the recipe and the checkpoint")
    im.set_defaults(func=cmd_import)

    ex = sub.add_parser("export", help="export a checkpoint in Hugging Face format",
                        description="Write a checkpoint (or a run directory's newest good one) as a Hugging Face model "
                        "directory: config.json and safetensors weights (sharded with an index above --max-shard-gib).")
    ex.add_argument("checkpoint", help="a checkpoint directory, or a run directory (its newest good checkpoint)")
    ex.add_argument("--out", required=True, metavar="DIR", help="a new directory for the model")
    ex.add_argument("--format", choices=["hf"], default="hf", help="hf: Hugging Face (the only format)")
    ex.add_argument("--layout", choices=["kda", "kimi_linear"], default="kda",
                    help="kda: fla's KDAForCausalLM (default); kimi_linear: Kimi-Linear's tensor names")
    ex.add_argument("--max-shard-gib", type=float, default=5.0, metavar="GiB", help="largest safetensors shard (default 5)")
    ex.set_defaults(func=cmd_export)

    ck = sub.add_parser("checkpoint", help="checkpoint maintenance", description="Maintain checkpoints.")
    cksub = ck.add_subparsers(title="commands", metavar="COMMAND")
    ck.set_defaults(func=missing_command("megaseq checkpoint", cksub))
    up = cksub.add_parser(
        "upgrade", help="write the manifest of checkpoints written before manifests",
        description="Give checkpoints written before megaseq wrote manifests (manifest.json: every file's size and "
        "SHA-256, checked on every load) a manifest, after reading each file whole; then they resume and evaluate.",
    )
    up.add_argument("path", help="a checkpoint, a run directory or its checkpoints/ directory")
    up.set_defaults(func=cmd_checkpoint_upgrade)

    pl = sub.add_parser(
        "plugins", help="list plugins and components",
        description="The components a recipe can name, the installed plugins providing them, their status.",
    )
    pl.add_argument("--json", action="store_true", help="machine-readable output")
    pl.add_argument(
        "--check", action="store_true",
        help="import every component's target (and memory target), run nothing else; exit status 2 on failure",
    )
    pl.set_defaults(func=cmd_plugins)

    d = sub.add_parser("data", help="datasets", description="Obtain and inspect the named datasets (data sources of the installed plugins).")
    dsub = d.add_subparsers(title="commands", metavar="COMMAND")
    d.set_defaults(func=missing_command("megaseq data", dsub))
    f = dsub.add_parser("fetch", help="download and tokenise a dataset", description="Fetch a dataset into the cache.")
    f.add_argument("name", help="dataset name (see 'megaseq data list')")
    f.add_argument("--cache-dir", help="default: $MEGASEQ_CACHE or ~/.cache/megaseq")
    f.set_defaults(func=cmd_data_fetch)
    ls = dsub.add_parser("list", help="known datasets", description="List the known datasets.")
    ls.set_defaults(func=cmd_data_list)

    for name, provided in sorted((commands or {}).items()):
        # listed for --help; ``main`` dispatches ``megaseq NAME ARGS...`` to the plugin before argparse runs
        sub.add_parser(name, help=f"{provided.spec.summary} [{provided.plugin.label}]", add_help=False)
    return p


def missing_command(prog: str, commands: argparse.Action):
    """What a command that needs a subcommand does without one: a one-line error naming the choices."""

    def run(args: argparse.Namespace) -> int:
        where = prog.removeprefix("megaseq").strip()
        raise UserError(f"{where + ': ' if where else ''}missing command; choose one of: {', '.join(commands.choices)} "
                        f"(see {prog} --help)")

    return run


def main(argv: list[str] | None = None) -> int:
    threads.apply_defaults()  # before anything imports torch: OpenMP reads its variables once, when it loads
    argv = sys.argv[1:] if argv is None else list(argv)
    _one_line_warnings()
    try:
        commands: dict[str, Any] = {}
        if not argv or argv[0] not in CORE_COMMANDS:  # a plugin's command, --help, or a mistake
            commands = plugin_commands(argv[0] if argv else None)
            if argv and argv[0] in commands:
                return run_plugin_command(commands[argv[0]], argv[1:])
            if argv and argv[0] in PACKAGED_COMMANDS:
                package = PACKAGED_COMMANDS[argv[0]]
                raise UserError(f"{argv[0]!r} is a command of the {package} package, which is not installed: "
                                f"pip install -e packages/{package.removeprefix('megaseq-')} (in a clone) or pip install {package}")
        args = parser(commands).parse_args(argv)
        return args.func(args)
    except UserError as exc:
        print(f"megaseq: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Interrupted (a signal during training) says what was saved
        print(f"megaseq: interrupted: {exc}" if str(exc) else "megaseq: interrupted", file=sys.stderr)
        return getattr(exc, "exit_status", 130)


if __name__ == "__main__":
    sys.exit(main())
