"""Hugging Face model directories: ``config.json`` and safetensors weights, one file or shards with an index.

Reading checks what a copy cut short or a wrong directory would break: the index names only files that exist
and are whole safetensors files, and every tensor it lists is in the shard it names. Writing produces the same
layout (``model.safetensors``, or ``model-00001-of-0000N.safetensors`` + ``model.safetensors.index.json`` when
the tensors exceed ``max_shard_bytes``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from megaseq.interop import InteropError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def read_config(directory: Path) -> dict[str, Any]:
    if not directory.is_dir():
        raise InteropError(f"{directory}: not a directory")
    path = directory / "config.json"
    if not path.is_file():
        raise InteropError(f"{directory}: not a Hugging Face model directory (no config.json)")
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise InteropError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise InteropError(f"{path}: not a JSON object")
    return config


def _read_file(path: Path, names: list[str] | None = None) -> dict[str, Tensor]:
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = list(f.keys())
            if names is not None:
                absent = sorted(set(names) - set(keys))
                if absent:
                    raise InteropError(f"{path}: tensor {absent[0]} is listed in {INDEX} but not in this shard")
            return {name: f.get_tensor(name) for name in (keys if names is None else names)}
    except (SafetensorError, OSError, RuntimeError) as exc:
        raise InteropError(f"{path}: not a readable safetensors file (truncated or damaged?): {exc}") from None


def read_tensors(directory: Path) -> dict[str, Tensor]:
    """Every tensor of the model in ``directory``, by its Hugging Face name."""
    index = directory / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            raise InteropError(f"{index}: not a safetensors index (no weight_map object)") from None
        by_file: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            by_file.setdefault(file, []).append(name)
        tensors: dict[str, Tensor] = {}
        for file, names in sorted(by_file.items()):
            shard = directory / file
            if not shard.is_file():
                raise InteropError(f"{index}: names {file}, which is missing")
            tensors.update(_read_file(shard, names))
        return tensors
    if (directory / SINGLE).is_file():
        return _read_file(directory / SINGLE)
    raise InteropError(f"{directory}: no {SINGLE} or {INDEX} (only safetensors weights are read)")


def write_model(directory: Path, config: dict[str, Any], tensors: dict[str, Tensor], max_shard_bytes: int) -> list[str]:
    """Write ``config.json`` and the tensors into ``directory`` (which exists); returns the files written."""
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(directory / SINGLE), metadata=metadata)
        return ["config.json", SINGLE]
    files, weight_map = [], {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / file), metadata=metadata)
        files.append(file)
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (directory / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    return ["config.json", *files, INDEX]


def same_tensors(a: dict[str, Tensor], b: dict[str, Tensor]) -> bool:
    """Bitwise equality of two tensor dicts (names, dtypes, shapes and bytes)."""

    def raw(t: Tensor) -> Tensor:
        return t.detach().reshape(-1).contiguous().view(torch.uint8)

    return a.keys() == b.keys() and all(
        a[n].dtype == b[n].dtype and a[n].shape == b[n].shape and torch.equal(raw(a[n]), raw(b[n])) for n in a
    )
