"""Repository rules that keep the plugin architecture honest.

- Core never imports a plugin; a plugin never imports another plugin (they meet only through core). The test
  kit (megaseq-testkit) is no plugin: a plugin's test helpers may import it, core never does.
- Every package has the layout docs/architecture.md describes: hatchling, src/ layout, static version,
  README, CHANGELOG, tests, and (plugins) a ranged megaseq-core dependency and a `megaseq` entry point.
- Every package declares the distributions it imports (dependencies or extras).
- Core names no plugin: no plugin's component, command, layout, distribution or import name in its source.
- Nothing in the repository cites documents that are not in it.
- Every dependency's floor is the major.minor that ``make setup`` installs and the tests run against.
- Code, docs and help texts describe today: no issue numbers, commit hashes, dates of work or narration.
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.parent for p in (REPO / "packages").glob("*/pyproject.toml"))
EXAMPLES = sorted(p.parent for p in (REPO / "examples").glob("*/pyproject.toml"))


def import_name(package: Path) -> str:
    (src,) = [p for p in (package / "src").iterdir() if p.is_dir() and not p.name.endswith(".egg-info")]
    return src.name


def imported_roots(package: Path) -> set[str]:
    roots = set()
    for path in (package / "src").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                roots |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                roots.add(node.module.split(".")[0])
    return roots


ALL_IMPORT_NAMES = {import_name(p) for p in PACKAGES + EXAMPLES}


@pytest.mark.parametrize("package", PACKAGES + EXAMPLES, ids=lambda p: p.name)
def test_no_cross_plugin_imports(package):
    own = import_name(package)
    allowed = {own} if own == "megaseq" else {own, "megaseq", "megaseq_testkit"}
    forbidden = (imported_roots(package) & ALL_IMPORT_NAMES) - allowed
    assert not forbidden, f"{package.name} imports {sorted(forbidden)}"


@pytest.mark.parametrize("package", PACKAGES + EXAMPLES, ids=lambda p: p.name)
def test_package_layout(package):
    meta = tomllib.loads((package / "pyproject.toml").read_text())
    assert meta["build-system"]["build-backend"] == "hatchling.build"
    name = import_name(package)
    assert (package / "src" / name / "__about__.py").read_text().startswith("__version__ = ")
    assert meta["tool"]["hatch"]["version"]["path"] == f"src/{name}/__about__.py"
    assert (package / "README.md").stat().st_size > 200, "README too short to be useful"
    assert list((package / "tests").glob("test_*.py")), "no tests"
    if package.parent.name == "packages":
        assert (package / "CHANGELOG.md").exists()
    if name != "megaseq":
        reqs = [Requirement(r) for r in meta["project"]["dependencies"]]
        core = [r for r in reqs if r.name == "megaseq-core"]
        assert core and core[0].specifier and "<" in str(core[0].specifier), "needs a ranged megaseq-core dependency"
    if name == "megaseq_testkit":
        assert meta["project"]["entry-points"]["pytest11"], "the kit's pytest plugin registers the markers"
    elif name != "megaseq":
        assert meta["project"]["entry-points"]["megaseq"], "no megaseq entry point"
        extras = meta["project"].get("optional-dependencies", {})
        kit = [Requirement(r) for r in extras.get("test", []) if Requirement(r).name == "megaseq-testkit"]
        assert kit and "<" in str(kit[0].specifier), "a plugin lists a ranged megaseq-testkit in its `test` extra"


def registered_records(package: Path) -> list:
    """Every record the package's registration hooks return (``megaseq.records``)."""
    from megaseq.records import SPEC_TYPES

    meta = tomllib.loads((package / "pyproject.toml").read_text())["project"]
    modules = ["megaseq.builtins", "megaseq.commands"] if meta["name"] == "megaseq-core" else list(meta["entry-points"].get("megaseq", {}).values())
    found = []
    for module_name in modules:
        module = importlib.import_module(module_name)
        for kind in SPEC_TYPES:
            hook = getattr(module, f"megaseq_{kind}", None)
            found += list(hook() if hook else [])
    return found


def registered_components(package: Path) -> dict[tuple[str, str], str]:
    """(kind, name) -> distribution, for every component the package's registration hooks return."""
    dist = tomllib.loads((package / "pyproject.toml").read_text())["project"]["name"]
    return {(spec.kind, spec.name): dist for spec in registered_records(package)}


def shipped_components() -> dict[tuple[str, str], str]:
    """(kind, name) -> distribution, for every component this repository's packages register."""
    shipped = {}
    for package in PACKAGES + EXAMPLES:
        shipped |= registered_components(package)
    return shipped


def test_no_citation_of_documents_outside_the_repository():
    outside = ["DESIGN" + ".md", "REFERENCE" + ".md"]  # the team's notes, not shipped: cite docs/ instead
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        path = REPO / name
        if path.suffix in {".py", ".md", ".toml", ".txt", ".cfg", ""} and path.is_file():
            text = path.read_text(errors="ignore")
            cited = [doc for doc in outside if doc in text]
            assert not cited, f"{name} cites {cited}, which are not in the repository"


# -- core names no other package's component, command, layout or distribution ------------------------------
# Core (packages/core/src: code, strings, docstrings and comments) meets the plugins only through its hooks, so
# it never names what a plugin registers or the plugin itself. The names come from the packages: each plugin
# package's (and example's) distribution and import name, and every record its hooks return (a layout's
# config.json model_type too). The test kit is no plugin: core's contracts cite its suites.
#
# A name matches a word of the text (runs of letters, digits, - and _) when its parts (split at - and _)
# appear in order among the word's parts, split the same way or also at case changes: ``Kimi-Linear's``
# names ``kimi_linear``, ``KDAForCausalLM`` names ``kda``, ``megaseq_kda.hf`` names ``megaseq_kda``.
# Two kinds of words are core's own and pass: core's hook and kind names (``megaseq_moe``,
# ``megaseq_rl_algorithm``, ``rl_algorithm``) except where a module path follows them (``megaseq_moe.hf``),
# and, for the plugin names listed in CORE_VOCABULARY, any use that is not one that names the component:
# quoted (``"offload"``), as a recipe section (``memory_policy.recompute``), as a command (``megaseq rl``), or
# followed by what it is (``the offload policy``, ``the chunked MoE``).
CORE_VOCABULARY = {
    "recompute": "MemoryEffect.recompute; activation recomputation",
    "offload": "MemoryEffect.offload_min_bytes; offloading saved tensors",
    "chunked": "the chunked loss, megaseq.model.chunked_token_losses",
    "rl": "the kind rl_algorithm; reinforcement learning",
    "grch37-chr20": "core's excerpts' files, grch37_chr20_excerpt.fa.gz",
    "grch37-chrX": "core's excerpts' files, grch37_chrX_excerpt.fa.gz",
}
# what follows a component's name when text names it, by kind
KIND_WORDS = {
    "attention": ("attention", "layer", "layers"), "ffn": ("ffn", "feed-forward", "MLP"), "moe": ("moe", "experts"),
    "memory_policy": ("policy", "policies"), "rl_algorithm": ("algorithm",), "inference_engine": ("engine",),
    "command": ("command",), "data_source": ("source", "dataset"), "baseline": ("baseline",),
    "eval_analysis": ("analysis",), "hf_layout": ("layout",),
}
NAME_WORD = re.compile(r"[A-Za-z0-9_-]+")
CASE_PART = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z0-9]+")


def plugin_names() -> dict[str, tuple[str, str]]:
    """name -> (kind, what it is) of everything the plugin packages of this repository are or register
    (kind: a record's kind, or "distribution" / "import")."""
    names: dict[str, tuple[str, str]] = {}
    for package in PACKAGES + EXAMPLES:
        dist = tomllib.loads((package / "pyproject.toml").read_text())["project"]["name"]
        if dist in ("megaseq-core", "megaseq-testkit"):
            continue
        names[dist] = ("distribution", f"the distribution {dist}")
        names[import_name(package)] = ("import", f"the import name of {dist}")
        for spec in registered_records(package):
            names.setdefault(spec.name, (spec.kind, f"{spec.kind} {spec.name!r} of {dist}"))
            if spec.kind == "hf_layout":
                names.setdefault(spec.model_type, (spec.kind, f"the model_type of {dist}'s layout {spec.name!r}"))
    return names


def _word_parts(word: str) -> tuple[list[str], list[str]]:
    pieces = [p for p in re.split(r"[-_]", word) if p]
    return [p.lower() for p in pieces], [c.lower() for p in pieces for c in CASE_PART.findall(p)]


def _holds(parts: list[str], name: list[str]) -> bool:
    return any(parts[i : i + len(name)] == name for i in range(len(parts) - len(name) + 1))


def _names_component(line: str, match: re.Match, name: str, kind: str) -> bool:
    """Whether the word at ``match`` (the plugin name ``name`` of ``kind``, also a word of core's) names the
    component rather than the thing core means by the word."""
    before, after = line[: match.start()], line[match.end() :]
    if match.group().lower() != name.lower():
        return False
    sections = ("attention", "ffn", "moe", "memory_policy", "baseline", "eval_analysis", kind)
    words = KIND_WORDS.get(kind, ())
    return (
        (before[-1:] in ("'", '"') and after[:1] in ("'", '"', "("))
        or any(before.endswith(f"{section}.") for section in sections)
        or (kind == "command" and before.endswith("megaseq "))
        or any(re.match(rf"\s+{re.escape(word)}\b", after, re.IGNORECASE) for word in words)
    )


def foreign_name_problems(name: str, text: str, names: dict[str, tuple[str, str]], core_words: set[str]) -> list[str]:
    """``name:line: names NAME (what it is)`` for each plugin name ``text`` names (see the comment above)."""
    wanted = {n: (kind, what, _word_parts(n)[0]) for n, (kind, what) in names.items()}
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for match in NAME_WORD.finditer(line):
            word = match.group()
            if word in core_words and not re.match(r"[.:][A-Za-z_]", line[match.end() :]):
                continue
            plain, by_case = _word_parts(word)
            for n, (kind, what, parts) in wanted.items():
                if not (_holds(plain, parts) or _holds(by_case, parts)):
                    continue
                if n in CORE_VOCABULARY and not _names_component(line, match, n, kind):
                    continue
                found.append(f"{name}:{number}: names {n!r} ({what}) in {word!r}")
    return found


def core_words() -> set[str]:
    """Core's own hook and kind names."""
    from megaseq import hookspecs
    from megaseq.records import SPEC_TYPES

    return {n for n in dir(hookspecs) if n.startswith("megaseq_")} | set(SPEC_TYPES)


def test_core_names_no_plugin():
    names = plugin_names()
    assert {"kda", "kimi_linear", "chunked", "markov", "megaseq-attn-kda", "megaseq_genome", "rl"} <= set(names)
    files = subprocess.run(["git", "ls-files", "packages/core/src"], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.split()
    words = core_words()
    problems = [p for f in files if Path(f).suffix in (".py", ".md", ".toml", ".txt")
                for p in foreign_name_problems(f, (REPO / f).read_text(), names, words)]
    assert not problems, "core meets plugins only through its hooks; say what core means without naming them:\n" + \
        "\n".join(problems[:40])


@pytest.mark.parametrize(
    ("line", "named"),
    [
        ('    layer_pattern = ["kda"]', "kda"),
        ("# KDA's recurrent state is carried between tiles", "kda"),
        ('LAYOUTS = ("kimi_linear",)', "kimi_linear"),
        ('"""Kimi-Linear' + "'s published names.\"\"\"", "kimi_linear"),
        ("from x import KDAConfig", "kda"),
        ('    mapping="megaseq_kda.hf:MAPPING",', "megaseq_kda"),
        ('MAPPING = "megaseq_moe.hf:MAPPING"', "megaseq_moe"),
        ("(megaseq-genome provides the chromosomes)", "megaseq-genome"),
        ('    ("eval", "markov_order"): "set eval.baselines"', "markov"),
        ('policies = ["offload"]', "offload"),
        ("see [memory_policy.recompute] in the recipe", "recompute"),
        ("what the offload policy uses", "offload"),
        ("the chunked MoE routes", "chunked"),
        ("(e.g. ``megaseq rl``)", "rl"),
        ("DSA's top-k key indices", "dsa"),
        ('data.train = "grch37-chr20"', "grch37-chr20"),
        ("the sliding-window example", "sliding-window"),
        ("an objective (GRPO, ...)", "grpo"),
    ],
)
def test_core_name_check_rejects_a_planted_line(line, named):
    problems = foreign_name_problems("packages/core/src/megaseq/m.py", f"x = 1\n{line}\n", plugin_names(), core_words())
    assert problems and all(p.startswith("packages/core/src/megaseq/m.py:2: ") for p in problems), problems
    assert any(p.split()[2] == repr(named) for p in problems), problems


@pytest.mark.parametrize(
    "line",
    [
        "    recompute: str | None = None",
        "    offload_min_bytes: int | None = None",
        "a forward that a recompute implementation will run again; offloading moves saved tensors",
        "raise ValueError(\"MemoryEffect.tile_tokens needs recompute = 'block'\")",
        "losses = chunked_token_losses(hidden, head)  # the chunked loss",
        "The RL loop's old log-probabilities; RLAlgorithm, RLAlgorithmSpec, the RL algorithms",
        "``megaseq_moe``, ``megaseq_rl_algorithm``, ``rl_algorithm``",
        'return EXCERPT_DIR / "grch37_chr20_excerpt.fa.gz"',
        "300 kb of GRCh37 chr20, a sliding window of keys",
    ],
)
def test_core_name_check_accepts_core_vocabulary(line):
    assert foreign_name_problems("m.py", line, plugin_names(), core_words()) == []


# import name -> distribution name, where they differ
DISTRIBUTION_OF = {"fla": "fla-core", "flash_attn": "flash-attn", "megaseq": "megaseq-core", "megaseq_testkit": "megaseq-testkit", "megatron": "megatron-core"}


@pytest.mark.parametrize("package", PACKAGES + EXAMPLES, ids=lambda p: p.name)
def test_every_imported_distribution_is_declared(package):
    import sys

    project = tomllib.loads((package / "pyproject.toml").read_text())["project"]
    extras = project.get("optional-dependencies", {}).values()
    requirements = [*project.get("dependencies", []), *(r for extra in extras for r in extra)]
    declared = {Requirement(r).name.lower() for r in requirements} | {project["name"]}
    imported = imported_roots(package) - set(sys.stdlib_module_names) - {import_name(package)}
    missing = sorted(DISTRIBUTION_OF.get(root, root) for root in imported if DISTRIBUTION_OF.get(root, root) not in declared)
    assert not missing, f"{package.name} imports {missing} without declaring them in pyproject.toml"


# -- docs, code and help texts describe today -------------------------------------------------------------
# No issue numbers, commit hashes, dates of work or narration of how the work went. The patterns are written
# so that this file does not match itself (``\s+`` between words, an optional suffix on single words).
HISTORY_SUFFIXES = {".py", ".md", ".toml"}
ISSUE_NUMBER = re.compile(r"(?i)\b(?:issues?|PRs?|pull\s+requests?)\s*#?\d+\b|(?<![\w&#/])#\d+(?![\w-])")
# 7-40 lower-case hex digits with at least one digit and one letter, standing alone (``_`` separates, so a
# hash inside a file name counts; a float's exponent after ``.`` and a UUID's groups between ``-`` do not)
COMMIT_HASH = re.compile(r"(?<![A-Za-z0-9.\-])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![A-Za-z0-9\-])")
NARRATION = re.compile(
    r"(?i)\b(?:this\s+session|end\s+of\s+the\s+session|the\s+session's|when\s+this\s+was\s+written|while\s+this\s+was\s+written|"
    r"at\s+the\s+time\s+of\s+writing|so\s+far|previous(?:ly)|former(?:ly)|since\s+then|at\s+commit|"
    r"previous\s+commit|yester(?:day)|earlier\s+today|today['’]s)\b"
    r"|\b20\d\d-[01]\d-[0-3]\d\b"  # a date of work
)
# (path, token) pairs of hex that is data, not a commit (a checksum test vector): keep this list short
HEX_ALLOWED: set[tuple[str, str]] = set()


def history_problems(name: str, text: str) -> list[str]:
    """``name:line: what`` for each line of ``text`` that cites an issue or a commit, or narrates history.
    A CHANGELOG.md is history by design: it may narrate, but cites no issue numbers or commit hashes."""
    changelog = Path(name).name == "CHANGELOG.md"
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        hits = [f"issue number {m.group(0)!r}" for m in ISSUE_NUMBER.finditer(line)]
        hits += [f"commit hash {m.group(0)!r}" for m in COMMIT_HASH.finditer(line) if (name, m.group(0)) not in HEX_ALLOWED]
        if not changelog:
            hits += [f"history {m.group(0)!r}" for m in NARRATION.finditer(line)]
        found += [f"{name}:{number}: {hit}" for hit in hits]
    return found


def tracked_text_files(root: Path) -> list[str]:
    names = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout.split()
    return [name for name in names if Path(name).suffix in HISTORY_SUFFIXES and (root / name).is_file()]


def history_problems_in(root: Path, names: list[str]) -> list[str]:
    return [problem for name in names for problem in history_problems(name, (root / name).read_text(errors="ignore"))]


def test_no_history_in_code_and_docs():
    problems = history_problems_in(REPO, tracked_text_files(REPO))
    assert not problems, "say what is true today, without issue numbers, commits or dates (docs/results.md holds " \
        "measurements with their commands):\n" + "\n".join(problems[:40])


def cli_help_texts() -> dict[str, str]:
    """``megaseq ... --help`` of every command and subcommand, core's and the installed plugins'."""
    import argparse
    import contextlib
    import importlib
    import io

    from megaseq import cli

    found = cli.commands()
    texts = {"megaseq": cli.parser(found).format_help()}

    def walk(parser: argparse.ArgumentParser, prog: str) -> None:
        texts[prog] = parser.format_help()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{prog} {name}")

    for name, provided in found.items():
        module = importlib.import_module(provided.spec.target.split(":")[0])
        if callable(getattr(module, "parser", None)):  # core's commands: subcommands' help too
            walk(module.parser(), f"megaseq {name}")
            continue
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            cli.run_command(provided, ["--help"])
        texts[f"megaseq {name}"] = out.getvalue()
    return texts


def test_no_history_in_cli_help():
    texts = cli_help_texts()
    assert {"megaseq", "megaseq train", "megaseq plan"} <= set(texts), sorted(texts)
    problems = [p for prog, text in texts.items() for p in history_problems(f"{prog} --help", text)]
    assert not problems, "\n".join(problems)


ISSUE_12 = "issue #" + "12"
HASH = "a6711" + "c6"


@pytest.mark.parametrize(
    ("name", "line", "what"),
    [
        ("README.md", f"as {ISSUE_12} asked", "issue number"),
        ("docs/x.md", "fixed in #" + "12.", "issue number"),
        ("packages/p/src/p/m.py", f"# measured at {HASH}, 8k tokens", "commit hash"),
        ("benchmarks/b.py", f'BASELINE = "train_throughput_{HASH}.json"', "commit hash"),
        ("packages/p/README.md", "The step was still running when this " + "was written.", "history"),
        ("packages/p/README.md", "peak 10.62 GiB so" + " far", "history"),
        ("docs/results.md", "Measured on 2026-" + "12-01 beside another job", "history"),
        ("pyproject.toml", '# "previous' + 'ly" 4e-3', "history"),
        ("packages/p/CHANGELOG.md", f"- {ISSUE_12}: the router", "issue number"),
        ("packages/p/CHANGELOG.md", f"- the router ({HASH})", "commit hash"),
    ],
)
def test_history_check_rejects_a_planted_line(tmp_path, name, line, what):
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# title\n\n{line}\n")
    problems = history_problems_in(tmp_path, [name])
    assert len(problems) == 1 and problems[0].startswith(f"{name}:3: {what}"), problems


@pytest.mark.parametrize(
    ("name", "line"),
    [
        ("docs/guide.md", "[5 the component](#5-the-component) and [5.4](#54-memory-policies)"),
        ("packages/p/CHANGELOG.md", "- 2026-" + "12-01: previous" + "ly the router collapsed"),  # a changelog narrates
        ("packages/p/src/p/m.py", "FLOAT_MAX = 3.4028235e38  # 1e-6 relative, 0x7fffffff, 1048576 tokens"),
        ("packages/p/src/p/m.py", 'LAUNCH = "123e4567-e89b-12d3-a456-426614174000"  # a UUID'),
        ("packages/p/tests/test_m.py", 'SHA256_EMPTY = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"'),
        ("docs/x.md", "the defaced cafebabe decade: 7 letters, no digit; color #1f77b4"),
    ],
)
def test_history_check_accepts_what_is_not_history(tmp_path, name, line):
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(line + "\n")
    assert history_problems_in(tmp_path, [name]) == []


def test_hex_allow_list_exempts_only_its_file(tmp_path, monkeypatch):
    vector = "deadbeef" + "01"
    monkeypatch.setattr(sys.modules[__name__], "HEX_ALLOWED", {("tests/vectors.py", vector)})
    for name in ("tests/vectors.py", "tests/other.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(f'VECTOR = "{vector}"\n')
    assert history_problems_in(tmp_path, ["tests/vectors.py"]) == []
    assert len(history_problems_in(tmp_path, ["tests/other.py"])) == 1


# -- docs/architecture.md lists what the code has ---------------------------------------------------------
ARCHITECTURE = REPO / "docs" / "architecture.md"


def doc_section(heading: str) -> str:
    """The text of ``## heading`` in docs/architecture.md, up to the next ``## `` heading."""
    text = ARCHITECTURE.read_text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def table_rows(section: str) -> list[list[str]]:
    """The body rows of the Markdown tables in ``section``, as lists of stripped cells."""
    rows = [line.strip().strip("|").split("|") for line in section.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row] for row in rows if not set(row[0].strip()) <= set("-:") and row[0].strip() not in ("hook", "command", "kind")]


def ticked(cell: str) -> str:
    (name,) = re.findall(r"`([^`]+)`", cell) or [cell]
    return name


def test_architecture_lists_every_package():
    (layout,) = re.findall(r"```text\n(.*?)```", doc_section("Repository layout"), re.DOTALL)
    listed = set(re.findall(r"^packages/([\w-]+)/", layout, re.MULTILINE))
    assert listed == {p.name for p in PACKAGES}, (
        f"docs/architecture.md's layout lists packages {sorted(listed)}, packages/ holds {sorted(p.name for p in PACKAGES)}"
    )


def test_architecture_lists_every_hook_kind_and_record():
    from megaseq import hookspecs
    from megaseq.records import SPEC_TYPES

    rows = {ticked(row[0]): row for row in table_rows(doc_section("Hooks"))}
    hooks = {name for name in dir(hookspecs) if name.startswith("megaseq_")}
    assert set(rows) == hooks, f"docs/architecture.md's hook table: add {sorted(hooks - set(rows))}, remove {sorted(set(rows) - hooks)}"
    for kind, record in SPEC_TYPES.items():
        row = rows[f"megaseq_{kind}"]
        assert (ticked(row[1]), ticked(row[2])) == (kind, record.__name__), f"docs/architecture.md: megaseq_{kind} registers kind {kind!r}, records {record.__name__}"
    lifecycle = hooks - {f"megaseq_{kind}" for kind in SPEC_TYPES}
    assert {name for name in lifecycle if rows[name][1] == "lifecycle"} == lifecycle, "lifecycle hooks are marked 'lifecycle'"


def test_architecture_lists_every_component():
    PROVIDERS = {key: dist for key, dist in shipped_components().items() if not (key[0] == "command" and dist == "megaseq-core")}
    rows = table_rows(doc_section("Components"))
    listed = {(ticked(kind), name): dist for kind, cell in rows for name, dist in re.findall(r"`([\w.-]+)` \(([\w-]+)", cell)}
    assert listed == PROVIDERS, "docs/architecture.md's component table must list what the packages register: " \
        f"add {sorted(set(PROVIDERS) - set(listed))}, remove {sorted(set(listed) - set(PROVIDERS))}"


def test_architecture_lists_every_command():
    listed = {ticked(row[0]): row[1] for row in table_rows(doc_section("Command line"))}
    expected = {}
    for package in PACKAGES + EXAMPLES:
        expected |= {name: "core" if dist == "megaseq-core" else dist
                     for (kind, name), dist in registered_components(package).items() if kind == "command"}
    wrong = sorted(set(listed.items()) ^ set(expected.items()))
    assert listed == expected, f"docs/architecture.md's command table and the code differ in (command, provider) {wrong}"


def test_core_readme_lists_every_module():
    core = REPO / "packages" / "core"
    modules = {p.stem for p in (core / "src" / "megaseq").iterdir() if (p.suffix == ".py" or (p / "__init__.py").exists())}
    modules -= {"__init__", "__about__"}
    rows = [line.split("|")[1] for line in (core / "README.md").read_text().splitlines() if line.startswith("| `megaseq.")]
    listed = {name for cell in rows for name in re.findall(r"`megaseq\.(\w+)`", cell)}
    assert listed == modules, f"packages/core/README.md's module table: add {sorted(modules - listed)}, remove {sorted(listed - modules)}"


# -- every collective goes through megaseq.parallel.collectives (it puts buffers on the group's device) --------
COLLECTIVES_MODULE = "packages/core/src/megaseq/parallel/collectives.py"
COLLECTIVE_NAMES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single",
    "broadcast", "broadcast_object_list", "reduce", "gather", "gather_object", "scatter", "scatter_object_list",
    "send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier", "monitored_barrier",
}


def direct_collectives(name: str, source: str) -> list[str]:
    """``name:line`` of every call of a ``torch.distributed`` collective (through any alias) in ``source``."""
    tree = ast.parse(source, filename=name)
    aliases = {"torch.distributed"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch" and node.level == 0:
            aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            problems += [f"{name}:{node.lineno}: imports {a.name}" for a in node.names if a.name in COLLECTIVE_NAMES]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVE_NAMES:
            if ast.unparse(node.func.value) in aliases:
                problems.append(f"{name}:{node.lineno}: calls {ast.unparse(node.func)}")
    return problems


def test_every_collective_goes_through_core_collectives():
    names = [n for n in subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True,
                                       check=True).stdout.split() if n != COLLECTIVES_MODULE]
    problems = [p for n in names for p in direct_collectives(n, (REPO / n).read_text())]
    assert not problems, f"call megaseq.parallel.collectives instead ({COLLECTIVES_MODULE}):\n" + "\n".join(problems)


@pytest.mark.parametrize(
    "source",
    [
        "import torch.distributed as dist\ndist.all_reduce(t)\n",
        "import torch\ntorch.distributed.barrier()\n",
        "from torch import distributed as d\nd.all_to_all_single(o, i)\n",
        "from torch.distributed import broadcast_object_list\n",
    ],
)
def test_collective_check_rejects_a_planted_call(source):
    assert len(direct_collectives("m.py", source)) == 1


def test_collective_check_accepts_queries_and_core_calls():
    source = "import torch.distributed as dist\nfrom megaseq.parallel import collectives\n" \
             "dist.get_world_size(g)\ncollectives.all_reduce(t, g)\ndist.init_process_group('gloo')\n"
    assert direct_collectives("m.py", source) == []


# -- dependency floors are what the tests run against ---------------------------------------------------------
def declared_requirements() -> list[tuple[str, Requirement, bool]]:
    """``(pyproject, requirement, optional)`` of every dependency, extra, build requirement and the root's dev
    group (``optional``: an extra, which an environment may lack: CUDA-only ones on a CPU machine)."""
    out = []
    for pyproject in [REPO / "pyproject.toml", *(p / "pyproject.toml" for p in PACKAGES + EXAMPLES)]:
        data = tomllib.loads(pyproject.read_text())
        project = data.get("project", {})
        where = str(pyproject.relative_to(REPO))
        required = [*project.get("dependencies", []), *data.get("build-system", {}).get("requires", []),
                    *data.get("dependency-groups", {}).get("dev", [])]
        extras = [r for extra in project.get("optional-dependencies", {}).values() for r in extra]
        out += [(where, Requirement(r), False) for r in required] + [(where, Requirement(r), True) for r in extras]
    return out


def major_minor(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:2])


def floor_problems(requirements: list[tuple[str, Requirement, bool]], installed: dict[str, str], torch_version: str) -> list[str]:
    """Every requirement has a floor; where the distribution is installed (``make setup`` installs every
    requirement and the extras core[distributed,hf] and attn-kda[hf]), the floor is its major.minor."""
    problems = []
    for where, req, optional in requirements:
        name = req.name.lower().replace("_", "-")
        if name.startswith("megaseq-"):
            continue  # the workspace's own packages: ranged by version, not by what pip resolves
        floors = [s.version for s in req.specifier if s.operator == ">="]
        if not floors:
            problems.append(f"{where}: {req} has no floor (>=)")
        elif name in installed:
            if major_minor(floors[0]) != major_minor(installed[name]):
                problems.append(f"{where}: {req}: floor {floors[0]}, but the tests run against {installed[name]}")
        elif not optional:
            problems.append(f"{where}: {req} is not installed here, so no test runs against it (make setup installs it)")
        if name == "torch" and floors and major_minor(floors[0]) != major_minor(torch_version):
            problems.append(f"{where}: {req}: floor {floors[0]}, but the Makefile installs torch {torch_version}")
    return problems


def test_dependency_floors_are_the_tested_versions():
    import importlib.metadata as md

    torch_version = re.search(r"^TORCH_VERSION := (\S+)", (REPO / "Makefile").read_text(), re.M).group(1)
    installed: dict[str, str] = {}
    for dist in md.distributions():  # in sys.path order: the first of a name is the one imports use
        installed.setdefault(dist.metadata["Name"].lower().replace("_", "-"), dist.version)
    problems = floor_problems(declared_requirements(), installed, torch_version)
    assert not problems, "\n".join(problems)


def test_floor_check_rejects_a_stale_floor():
    installed = {"numpy": "2.4.6", "torch": "2.13.0"}
    stale = [("p", Requirement("numpy>=1.26"), False), ("p", Requirement("torch>=2.4"), False),
             ("p", Requirement("scipy>=1.0"), False), ("p", Requirement("numpy"), True)]
    problems = floor_problems(stale, installed, "2.13.0")
    assert [p.split(": ", 2)[-1] for p in problems] == [
        "floor 1.26, but the tests run against 2.4.6",
        "floor 2.4, but the tests run against 2.13.0",
        "floor 2.4, but the Makefile installs torch 2.13.0",
        "scipy>=1.0 is not installed here, so no test runs against it (make setup installs it)",
        "numpy has no floor (>=)",
    ]
    fine = [("p", Requirement("numpy>=2.4,<3"), False), ("p", Requirement("vllm>=0.33"), True)]  # an extra not installed here
    assert floor_problems(fine, installed, "2.13.0") == []


def test_architecture_names_every_contract_and_suite():
    """Every Protocol of ``megaseq.contracts`` (and the engine's), the records a contract hands a component
    (``EvalInfo``), and every conformance suite of ``megaseq_testkit`` appear in docs/architecture.md."""
    import inspect
    import pkgutil
    from typing import Protocol

    import megaseq_testkit
    from megaseq import contracts, inference

    text = (REPO / "docs" / "architecture.md").read_text()
    protocols = {name for module in (contracts, inference) for name, obj in vars(module).items()
                 if inspect.isclass(obj) and Protocol in getattr(obj, "__mro__", ()) and obj is not Protocol
                 and obj.__module__ == module.__name__ and not name.startswith("_")}
    suites = set()
    for info in pkgutil.iter_modules(megaseq_testkit.__path__):
        if info.name in ("hopper", "pytest_plugin"):  # hopper needs triton; the pytest plugin holds no suite
            continue
        module = importlib.import_module(f"megaseq_testkit.{info.name}")
        suites |= {name for name, obj in vars(module).items()
                   if inspect.isclass(obj) and name.endswith("Conformance") and obj.__module__ == module.__name__}
    missing = sorted(name for name in protocols | suites | {"EvalInfo"} if f"`{name}`" not in text)
    assert protocols and suites and not missing, f"docs/architecture.md does not name {missing}"
