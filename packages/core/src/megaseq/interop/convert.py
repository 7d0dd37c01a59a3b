"""``megaseq import`` and ``megaseq export``: walk a Hugging Face config and its layers, let each component's
mapping convert its own part, check the result against the model the recipe builds.

The layouts are the installed plugins' (``megaseq_hf_layout``): import finds one by ``config.json``'s
``model_type``, export by its name (``--layout``). A component's mapping comes from the layout where the
layout carries one for it, else from the component's record.

Import writes ``OUT/recipe.toml`` and a verified checkpoint ``OUT/checkpoints/step_0000000`` (what
``megaseq train --init-from OUT``, ``megaseq eval OUT`` and the inference engines read). Export writes
``config.json`` and safetensors weights. Both check everything before writing anything, write into a staging
directory beside ``OUT`` and rename it into place, and refuse an ``OUT`` that exists: a mistake leaves
nothing behind and overwrites nothing.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from megaseq.config import Recipe, validate_recipe
from megaseq.data.tokenizer import VOCAB
from megaseq.interop import InteropError, Tensors
from megaseq.interop.files import read_config, read_tensors, write_model
from megaseq.interop.layouts import Layer, Layout
from megaseq.interop.recipe_toml import dumps
from megaseq.interop.tokens import token_ids_for
from megaseq.model import LanguageModel, build_model
from megaseq.plugins import Plugins, Provided
from megaseq.records import ModelDims, mapping_problem

DEFAULT_SHARD_BYTES = 5 * 2**30
KIND = "hf_layout"


@dataclass(frozen=True)
class NamedLayout:
    """A registered layout: its record's ``name`` (what mappings are told) and ``model_type``, its loaded
    :class:`Layout`, and ``provider``, the plugin that registered it (for errors)."""

    name: str
    model_type: str
    layout: Layout
    provider: str


def _installed(plugins: Plugins) -> str:
    found = sorted(plugins.registry[KIND].items())
    if not found:
        return "none is installed (plugins register them: `megaseq plugins` lists what is installed)"
    return "installed: " + ", ".join(f"{name} (model_type {p.spec.model_type!r}, from {p.plugin.label.strip()})" for name, p in found)


def _load(provided: Provided) -> NamedLayout:
    layout = provided.load()
    problem = provided.spec.loaded_problem("target", layout)
    if problem:
        raise InteropError(f"hf_layout {provided.spec.name!r} from {provided.plugin.label.strip()}: target "
                           f"{provided.spec.target!r}: {problem}")
    return NamedLayout(provided.spec.name, provided.spec.model_type, layout, provided.plugin.label.strip())


def layout_named(plugins: Plugins, name: str | None) -> NamedLayout:
    """The installed layout ``name`` (``megaseq export --layout``); ``None``: the one an installed layout
    declares ``default``. Anything else is one line listing the installed layouts."""
    registered = plugins.registry[KIND]
    if name is None:
        defaults = sorted(n for n, p in registered.items() if p.spec.default)
        if len(defaults) != 1:
            why = ("no installed layout declares itself the default" if not defaults
                   else f"{' and '.join(defaults)} each declare themselves the default")
            raise InteropError(f"--layout: choose a layout ({why}); {_installed(plugins)}")
        name = defaults[0]
    if (KIND, name) in plugins.conflicts:
        plugins.get(KIND, name)  # the one-line conflict message naming both providers
    if name not in registered:
        raise InteropError(f"--layout {name!r}: no such Hugging Face layout; {_installed(plugins)}")
    return _load(registered[name])


def layout_for(hf: dict[str, Any], plugins: Plugins, source: str) -> NamedLayout:
    """The installed layout of a ``config.json`` by its ``model_type``; any other is refused in one line."""
    model_type = hf.get("model_type")
    found = sorted((n, p) for n, p in plugins.registry[KIND].items() if p.spec.model_type == model_type)
    if not found:
        raise InteropError(f"{source}: model_type {model_type!r} is not supported; Hugging Face layouts {_installed(plugins)}")
    if len(found) > 1:
        named = " and ".join(f"{n} (from {p.plugin.label.strip()})" for n, p in found)
        raise InteropError(f"{source}: model_type {model_type!r} is read by several layouts, {named}; "
                           "uninstall all but one or set MEGASEQ_PLUGINS")
    return _load(found[0][1])


def _mapping(plugins: Plugins, layout: NamedLayout, kind: str, name: str) -> Any:
    mapping = layout.layout.mappings.get((kind, name))
    if mapping is None:
        mapping = plugins.get(kind, name).spec.load_mapping()
    if mapping is None:
        raise InteropError(f"{kind} {name!r} has no Hugging Face mapping for the layout {layout.name!r} (its record "
                           f"declares no mapping, and the layout, from {layout.provider}, carries none for it)")
    problem = mapping_problem(mapping)
    if problem:
        raise InteropError(f"{kind} {name!r}: its mapping {problem} (megaseq.interop.ComponentMapping)")
    return mapping


def _check_new(out: Path) -> None:
    if out.exists():
        raise InteropError(f"{out}: already exists; choose a new output directory (nothing is overwritten)")


@contextmanager
def _staged(out: Path) -> Iterator[Path]:
    """A fresh directory beside ``out`` that becomes ``out`` when the block completes (else is removed).

    Its name is made unique by ``tempfile.mkdtemp``: a fixed name could be a directory of the user's, which
    megaseq must neither delete nor write into. Only the directory made here is ever removed.
    """
    _check_new(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.staging-", dir=out.parent))
    try:
        yield staging
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _model_section(layout: Layout, hf: dict[str, Any], layers: list[Layer], source: str) -> dict[str, Any]:
    model = layout.model_fields(hf, source)
    pattern = [layer.attention for layer in layers]
    model["layer_pattern"] = pattern[:1] if len(set(pattern)) == 1 else pattern
    dense = [layer.ffn for layer in layers if layer.ffn_kind == "ffn"]
    moe = [layer.ffn for layer in layers if layer.ffn_kind == "moe"]
    if dense:
        model["ffn"] = dense[0]
    if moe:
        model["moe"], model["dense_layers"] = moe[0], len(dense)
    return model


def _layer_names(layout: Layout, i: int, layer: Layer) -> dict[str, tuple[str, str]]:
    """``megaseq prefix -> (Hugging Face prefix, what)`` of layer i's sub-modules."""
    base = layout.layer_prefix.format(i)
    return {
        f"blocks.{i}.attention.": (base + layer.attention_prefix, "attention"),
        f"blocks.{i}.ffn.": (base + layer.ffn_prefix, layer.ffn_kind),
    }


def _ffn_prefix_in(whole: Tensors, base: str, layer: Layer, source: str) -> str:
    """The prefix the layer's MLP tensors are written under: the layout's own, or one of its aliases."""
    written = [base + p for p in (layer.ffn_prefix, *layer.ffn_prefix_aliases) if any(n.startswith(base + p) for n in whole)]
    if len(written) > 1:
        raise InteropError(f"{source}: the MLP of one layer has tensors under both {written[0]} and {written[1]}")
    return written[0] if written else base + layer.ffn_prefix


def _check_fits(state: dict[str, Tensor], model: LanguageModel, source: str) -> None:
    expected = model.state_dict()
    for name, tensor in state.items():
        if name not in expected:
            raise InteropError(f"{source}: the mapping produced {name}, which the model has no place for")
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise InteropError(
                f"{source}: {name} has shape {list(tensor.shape)}, the config says {list(expected[name].shape)}"
            )
    missing = sorted(set(expected) - set(state))
    if missing:
        raise InteropError(f"{source}: no tensor for {missing[0]}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))


def recipe_from_hf(
    hf: dict[str, Any], plugins: Plugins, source: str, extra: dict[str, Any] | None = None
) -> tuple[Recipe, NamedLayout, list[Layer]]:
    """The recipe describing the model of ``config.json`` ``hf`` (``extra``: more recipe sections)."""
    named = layout_for(hf, plugins, source)
    layers = named.layout.layers(hf, source)
    raw: dict[str, Any] = {"model": _model_section(named.layout, hf, layers, source), **(extra or {})}
    for layer in layers:
        for kind, name in (("attention", layer.attention), (layer.ffn_kind, layer.ffn)):
            if name not in raw.setdefault(kind, {}):
                table = _mapping(plugins, named, kind, name).config_from_hf(hf, named.name)
                raw[kind][name] = {k: v for k, v in table.items() if v is not None}
    return validate_recipe(raw, plugins, source=source), named, layers


def import_model(src: Path, out: Path, plugins: Plugins) -> Path:
    """Convert the Hugging Face model directory ``src`` into ``out`` (recipe + checkpoint); returns the checkpoint."""
    from megaseq.train import checkpoint

    src = Path(src)
    _check_new(Path(out))  # before any reading; checked again when the result moves into place
    hf = read_config(src)
    extra: dict[str, Any] = {"run": {"name": src.resolve().name}}
    token_ids = token_ids_for(src, hf.get("vocab_size", 0))
    if token_ids is not None:
        extra["data"] = {"token_ids": token_ids}
    recipe, layout, layers = recipe_from_hf(hf, plugins, str(src / "config.json"), extra)
    model = model_from_hf(read_tensors(src), recipe, layout, layers, plugins, str(src))
    with _staged(Path(out)) as staging:
        (staging / "recipe.toml").write_text(dumps(recipe.to_dict()))
        root = staging / "checkpoints"
        meta = {"tokens": 0, "recipe": recipe.to_dict(), "plugins": plugins.active(), "imported_from": str(src.resolve())}
        path = checkpoint.save_checkpoint(root, 0, model, {}, meta)
        final = Path(out) / "checkpoints" / path.name
    return final


def model_from_hf(
    tensors: dict[str, Tensor], recipe: Recipe, layout: NamedLayout, layers: list[Layer], plugins: Plugins, source: str
) -> LanguageModel:
    """The recipe's model holding the Hugging Face ``tensors`` (every one mapped, every shape checked)."""
    state = _state_from_hf(tensors, recipe, layout, layers, plugins, source)
    with torch.device("meta"):
        shapes = build_model(recipe, plugins)
    _check_fits(state, shapes, source)
    model = build_model(recipe, plugins)
    model.load_state_dict({k: v.to(model.state_dict()[k].dtype) for k, v in state.items()}, strict=True)
    return model


def _state_from_hf(
    pool: dict[str, Tensor], recipe: Recipe, named: NamedLayout, layers: list[Layer], plugins: Plugins, source: str
) -> dict[str, Tensor]:
    m, layout = recipe.model, named.layout
    dims = ModelDims(d_model=m.d_model, n_layers=m.n_layers, vocab_size=m.vocab_size)
    whole = Tensors(pool, "", source)
    state = {"embed.weight": whole.take(layout.embed), "final_norm.weight": whole.take(layout.final_norm)}
    if recipe.model.tie_embeddings:
        if whole.has(layout.head) and not torch.equal(whole.take(layout.head), state["embed.weight"]):
            raise InteropError(f"{source}: tie_word_embeddings is true but {layout.head} differs from {layout.embed}")
    else:
        state["head.weight"] = whole.take(layout.head)
    for i, layer in enumerate(layers):
        base = layout.layer_prefix.format(i)
        state[f"blocks.{i}.attn_norm.weight"] = whole.take(base + layout.attn_norm)
        state[f"blocks.{i}.ffn_norm.weight"] = whole.take(base + layout.ffn_norm)
        for ours, (theirs, kind) in _layer_names(layout, i, layer).items():
            name = layer.attention if kind == "attention" else layer.ffn
            if kind != "attention":
                theirs = _ffn_prefix_in(whole, base, layer, source)
            sub = {n[len(theirs):]: whole.take(n) for n in list(whole) if n.startswith(theirs)}
            tensors = Tensors(sub, theirs, source)
            mapped = _mapping(plugins, named, kind, name).tensors_from_hf(tensors, recipe.component(kind, name), dims, named.name)
            if tensors.left():
                raise InteropError(f"{source}: unknown tensor {tensors.left()[0]} ({kind} {name!r} does not map it)")
            state.update({ours + k: v for k, v in mapped.items()})
    if whole.left():
        raise InteropError(f"{source}: unknown tensor {whole.left()[0]}")
    return state


def _special_token_ids(recipe: Recipe) -> dict[str, int | None]:
    """``pad_token_id``: the id of N (an unknown base, what a padded position holds). megaseq feeds no
    begin or end token: ``bos_token_id`` and ``eos_token_id`` are null. Written always, because a model
    class's own defaults (ids of a large vocabulary, e.g. 163839) lie outside a small vocabulary."""
    n = (recipe.data.token_ids or list(range(len(VOCAB))))[VOCAB.index("N")]
    return {"pad_token_id": n if n < recipe.model.vocab_size else None, "bos_token_id": None, "eos_token_id": None}


def model_to_hf(
    model: LanguageModel, recipe: Recipe, layout_name: str | None, plugins: Plugins
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """``(config.json, tensors)`` of a megaseq model in the installed layout ``layout_name`` (``None``: the
    default one, :func:`layout_named`)."""
    named = layout_named(plugins, layout_name)
    layout, layout_name = named.layout, named.name
    m = recipe.model
    dims = ModelDims(d_model=m.d_model, n_layers=m.n_layers, vocab_size=m.vocab_size)
    hf = layout.model_to_hf(m, named.model_type)
    hf.update(_special_token_ids(recipe))
    used = [(kind, name) for kind, name in {("attention", m.attention_of(i)): 0 for i in range(m.n_layers)}]
    used += list({m.ffn_of(i): 0 for i in range(m.n_layers)})
    for kind, name in used:
        for key, value in _mapping(plugins, named, kind, name).config_to_hf(recipe.component(kind, name), dims, layout_name).items():
            if key in hf and hf[key] != value:
                raise InteropError(f"{kind} {name!r}: config.json field {key} = {value!r} conflicts with {hf[key]!r}")
            hf[key] = value
    layout.place(hf, [m.attention_of(i) for i in range(m.n_layers)], [m.ffn_of(i) for i in range(m.n_layers)])
    layers = layout.layers(hf, f"--layout {layout_name}")
    for i, layer in enumerate(layers):
        if (layer.attention, (layer.ffn_kind, layer.ffn)) != (m.attention_of(i), m.ffn_of(i)):
            raise InteropError(
                f"--layout {layout_name}: cannot hold layer {i} (attention {m.attention_of(i)!r}, "
                f"{m.ffn_of(i)[0]} {m.ffn_of(i)[1]!r}); it holds {layer.attention!r} with {layer.ffn_kind} {layer.ffn!r}"
            )
    state = model.state_dict()
    tensors = {layout.embed: state["embed.weight"], layout.final_norm: state["final_norm.weight"]}
    if model.head is not None:
        tensors[layout.head] = state["head.weight"]
    elif not layout.ties_head:
        tensors[layout.head] = state["embed.weight"].clone()  # safetensors refuses two names for one storage
    for i, layer in enumerate(layers):
        base = layout.layer_prefix.format(i)
        tensors[base + layout.attn_norm] = state[f"blocks.{i}.attn_norm.weight"]
        tensors[base + layout.ffn_norm] = state[f"blocks.{i}.ffn_norm.weight"]
        for ours, (theirs, kind) in _layer_names(layout, i, layer).items():
            name = layer.attention if kind == "attention" else layer.ffn
            sub = {n[len(ours):]: t for n, t in state.items() if n.startswith(ours)}
            mapped = _mapping(plugins, named, kind, name).tensors_to_hf(sub, recipe.component(kind, name), dims, layout_name)
            tensors.update({theirs + k: v for k, v in mapped.items()})
    return hf, tensors


def export_checkpoint(
    path: Path, out: Path, layout_name: str | None, plugins: Plugins, max_shard_bytes: int = DEFAULT_SHARD_BYTES
) -> list[str]:
    """Write the megaseq checkpoint (or run directory) ``path`` as a Hugging Face model directory ``out`` in the
    layout ``layout_name`` (``None``: the default one)."""
    from megaseq.distributed.sharded import read_full_weights
    from megaseq.train import checkpoint

    _check_new(Path(out))
    path = checkpoint.resolve(Path(path))
    meta = checkpoint.read_meta(path)
    recipe = validate_recipe(meta["recipe"], plugins, source=f"{path}/meta.json")
    model = build_model(recipe, plugins)
    checkpoint.load_weights(path, model, read_full_weights(path, meta))
    hf, tensors = model_to_hf(model, recipe, layout_name, plugins)
    with _staged(Path(out)) as staging:
        return write_model(staging, hf, tensors, max_shard_bytes)
