"""Install the torch build the Makefile asks for into the running Python: ``cpu`` (the default) or ``cuda``.

Why this is not one ``pip install torch``: on Linux x86-64, PyPI's torch wheel is the CUDA build (it pulls
in about 20 ``nvidia-*`` packages, several GB); the CPU-only build is published on PyTorch's own index,
https://download.pytorch.org/whl/cpu, with the version ``X+cpu``. So:

- ``cpu``: ``torch==X+cpu``. PyTorch's CPU index is added, unless pip can already get that exact wheel
  without any index (a ``find-links`` directory in pip's configuration, see ``pip config list``: machines
  without internet keep a local wheel that way), then nothing is added and nothing is downloaded.
- ``cuda``: ``torch==X`` from PyPI, the CUDA build.

An installed torch of the other build is uninstalled first. Afterwards ``torch.version.cuda`` is checked, so
a wrong build (say pip's configuration preferring a local CPU wheel when the CUDA one was asked for) is a
one-line error, not a surprise later.

Usage (with the venv's python): ``python tools/install_torch.py {cpu,cuda} VERSION [--print]``;
``--print`` prints the pip arguments and installs nothing.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def pip(*args: str, quiet: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=quiet, text=True, check=False)


def local_wheel_available(requirement: str) -> bool:
    """Whether pip, as configured, resolves ``requirement`` with no index at all (find-links only)."""
    probe = pip("install", "--dry-run", "--no-deps", "--no-index", "--ignore-installed", "--quiet", requirement)
    return probe.returncode == 0


def pip_arguments(build: str, version: str) -> list[str]:
    if build == "cuda":
        return [f"torch=={version}"]
    requirement = f"torch=={version}+cpu"
    return [requirement] if local_wheel_available(requirement) else [requirement, "--extra-index-url", CPU_INDEX]


def installed_build() -> tuple[str, str] | None:
    """``(version, "cpu" | "cuda")`` of the torch installed in this Python, or None."""
    probe = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.__version__, 'cpu' if torch.version.cuda is None else 'cuda')"],
        capture_output=True, text=True, check=False,
    )
    if probe.returncode != 0:
        return None
    version, build = probe.stdout.split()
    return version, build


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("build", choices=["cpu", "cuda"])
    parser.add_argument("version", help="e.g. 2.13.0")
    parser.add_argument("--print", action="store_true", help="print the pip arguments, install nothing")
    args = parser.parse_args()
    if args.print:
        print(" ".join(pip_arguments(args.build, args.version)))
        return 0
    current = installed_build()
    if current is not None and current[0].split("+")[0] == args.version and current[1] == args.build:
        return 0
    arguments = pip_arguments(args.build, args.version)
    if current is not None:
        print(f"install_torch: replacing torch {current[0]} ({current[1]} build) with the {args.build} build", file=sys.stderr)
        pip("uninstall", "--yes", "--quiet", "torch", quiet=False)
    print(f"install_torch: pip install {' '.join(arguments)}", file=sys.stderr)
    if pip("install", "--quiet", *arguments, quiet=False).returncode != 0:
        print(f"install_torch: error: pip could not install the {args.build} build of torch {args.version}", file=sys.stderr)
        return 1
    got = installed_build()
    if got is None or got[1] != args.build:
        print(f"install_torch: error: TORCH={args.build} asked, but pip installed torch {got[0] if got else '(none)'}, "
              f"a {got[1] if got else 'broken'} build; check pip's configuration (pip config list)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
