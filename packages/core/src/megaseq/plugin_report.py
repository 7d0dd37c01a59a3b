"""``megaseq plugins``: what is installed, which components a recipe can name, and what is wrong.

The listing leads with the components (the names recipes use, each with the optional capabilities its
record declares, ``megaseq.records.CAPABILITIES``), then the plugins that provide them with their status,
then conflicts. ``--json`` prints the plugins as records; ``--check`` imports every target
(and memory target) and runs nothing else, exiting with status 2 if any fails to import.
"""

from __future__ import annotations

import json

from megaseq.plugins import Plugins


def report(plugins: Plugins) -> str:
    """The human-readable listing."""
    infos = list(plugins)  # statuses are final only after collection
    lines = ["Components (the names a recipe uses):"]
    rows = [
        (kind, name, found.plugin.label, found.spec.summary + _capabilities(found.spec))
        for kind, components in plugins.registry.items()
        for name, found in sorted(components.items())
    ]
    rows += [
        (kind, name, " + ".join(i.label for i in providers), "CONFLICT: provided twice, unusable")
        for (kind, name), providers in sorted(plugins.conflicts.items())
    ]
    widths = [max((len(r[i]) for r in rows), default=0) for i in range(3)]
    for kind, name, label, summary in sorted(rows):
        lines.append(f"  {kind:<{widths[0]}}  {name:<{widths[1]}}  {label:<{widths[2]}}  {summary}".rstrip())
    lines.append("Plugins (distribution version, entry point: status):")
    for info in infos:
        reason = f" ({info.reason})" if info.reason else ""
        lines.append(f"  {info.dist} {info.version}, {info.name}: {info.status}{reason}")
        lines.extend(f"    conflict: {c}" for c in info.conflicts)
    return "\n".join(lines)


def _capabilities(spec: object) -> str:
    declared = sorted(getattr(spec, "capabilities", ()))  # commands are records without capabilities
    return f" [{', '.join(declared)}]" if declared else ""


def run(plugins: Plugins, *, as_json: bool = False, check: bool = False) -> int:
    """Print the listing (or the import check); return the exit status."""
    if check:
        failures = plugins.check()
        broken = [i for i in plugins if i.status == "broken"]
        for info in broken:
            print(f"{info.label} ({info.name}): broken: {info.reason}")
        for line in failures:
            print(line)
        n_targets = sum(len(c) for c in plugins.registry.values())
        if failures or broken:
            print(f"{len(failures) + len(broken)} problem(s)")
            return 2
        print(f"all {n_targets} components' targets import")
        return 0
    if as_json:
        print(json.dumps([vars(i) for i in plugins], indent=2))
    else:
        print(report(plugins))
    return 0


__all__ = ["report", "run"]
