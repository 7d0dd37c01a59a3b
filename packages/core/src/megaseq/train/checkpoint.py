"""Checkpoints: one directory per step, written atomically (temporary directory + rename).

Layout of ``OUT/checkpoints/step_0000100/``: ``model.safetensors`` (weights), ``state.pt`` (optimizer,
schedule, RNG states, data position, plugin state), ``meta.json`` (step, tokens, the recipe, the active
plugins and versions). ``OUT/checkpoints/latest`` names the newest complete one.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_model, save_model

from megaseq.__about__ import __version__
from megaseq.errors import UserError


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_checkpoint(root: Path, step: int, model: torch.nn.Module, state: dict[str, Any], meta: dict[str, Any]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:07d}"
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".tmp-"))
    try:
        save_model(model, str(tmp / "model.safetensors"))  # handles tied embedding / head weights
        torch.save(state, tmp / "state.pt")
        meta = {"step": step, "megaseq_version": __version__, "time": time.time(), **meta}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _write_atomic(root / "latest", final.name + "\n")
    return final


def latest_checkpoint(root: Path) -> Path | None:
    pointer = root / "latest"
    if not pointer.exists():
        return None
    path = root / pointer.read_text().strip()
    return path if path.is_dir() else None


def read_meta(path: Path) -> dict[str, Any]:
    meta_file = path / "meta.json"
    if not meta_file.exists():
        raise UserError(f"{path}: not a megaseq checkpoint (no meta.json)")
    return json.loads(meta_file.read_text())


def load_weights(path: Path, model: torch.nn.Module) -> None:
    missing, unexpected = load_model(model, str(path / "model.safetensors"), strict=False)
    if missing or unexpected:
        raise UserError(f"{path}: checkpoint does not match the model (missing {missing[:3]}, unexpected {unexpected[:3]})")


def load_state(path: Path) -> dict[str, Any]:
    return torch.load(path / "state.pt", weights_only=False)
