"""Checkpoint files: the manifest is written last and describes every file; verification catches each kind
of damage; staged files of several writers are published by one commit; pruning and leftovers."""

from __future__ import annotations

import json
import os

import pytest
import torch

from megaseq.train import checkpoint
from megaseq.train.checkpoint import CheckpointError


def save(root, step, model=None):
    model = model or torch.nn.Linear(4, 3)
    return checkpoint.save_checkpoint(root, step, model, {"tokens": step}, {"recipe": {}})


def test_manifest_lists_every_file_and_is_written_last(tmp_path, monkeypatch):
    order = []
    real_replace = os.replace

    def recording_replace(src, dst):
        order.append(os.path.basename(dst))
        return real_replace(src, dst)

    monkeypatch.setattr(checkpoint.os, "replace", recording_replace)
    path = save(tmp_path, 3)
    manifest = json.loads((path / "manifest.json").read_text())
    assert set(manifest["files"]) == {"model.safetensors", "state.pt", "meta.json"}
    for name, entry in manifest["files"].items():
        assert entry["bytes"] == (path / name).stat().st_size
    # the manifest is complete before the directory is published, and `latest` moves after that
    assert order == ["manifest.json", "step_0000003", "latest"]
    assert checkpoint.verify(path) == manifest
    assert not list(tmp_path.glob(".tmp-*"))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: (p / "model.safetensors").write_bytes((p / "model.safetensors").read_bytes()[:40]), "model.safetensors has 40 bytes"),
        (lambda p: (p / "state.pt").unlink(), "state.pt is missing"),
        (lambda p: (p / "meta.json").write_text(""), "meta.json has 0 bytes"),
        (lambda p: (p / "manifest.json").unlink(), "no manifest.json"),
        (lambda p: (p / "manifest.json").write_text("{"), "manifest.json is unreadable"),
        # same size, one byte changed: only the checksum can tell
        (lambda p: (p / "state.pt").write_bytes(bytes([(p / "state.pt").read_bytes()[0] ^ 1]) + (p / "state.pt").read_bytes()[1:]),
         "state.pt does not match its SHA-256"),
    ],
    ids=["truncated-weights", "missing-state", "empty-meta", "no-manifest", "bad-manifest", "flipped-byte"],
)
def test_verify_catches_damage(tmp_path, damage, message):
    path = save(tmp_path, 1)
    damage(path)
    with pytest.raises(CheckpointError, match=message) as err:
        checkpoint.verify(path)
    assert "\n" not in str(err.value)


def test_newest_verified_skips_damaged_and_says_why(tmp_path):
    for step in (1, 2, 3):
        save(tmp_path, step)
    (tmp_path / "step_0000003" / "state.pt").unlink()
    found = checkpoint.newest_verified(tmp_path)
    assert found.path == tmp_path / "step_0000002"
    assert found.report() == "step_0000003 is damaged (state.pt is missing); resuming from step_0000002"
    # `latest` names a directory that is gone: still found, and said
    (tmp_path / "latest").write_text("step_0000009\n")
    assert "latest names step_0000009, which does not exist" in checkpoint.newest_verified(tmp_path).report()
    (tmp_path / "latest").write_text("")
    assert "latest is empty" in checkpoint.newest_verified(tmp_path).report()
    for step in (1, 2):
        (tmp_path / checkpoint.step_name(step) / "model.safetensors").unlink()
    none = checkpoint.newest_verified(tmp_path)
    assert none.path is None and none.report().endswith("no usable checkpoint")


def test_several_writers_share_one_manifest(tmp_path):
    """The per-rank layout a sharded checkpoint uses: every writer stages its files, one commit publishes."""
    staged = checkpoint.staging_dir(tmp_path, 5)
    described = {}
    for rank in range(2):
        torch.save({"rank": rank}, staged / f"optimizer.rank{rank}.pt")
        (staged / "experts").mkdir(exist_ok=True)
        torch.save({"w": torch.ones(rank + 1)}, staged / "experts" / f"rank{rank}.pt")
        if rank == 1:  # this rank hashes its own files; the committing rank hashes the rest
            described |= checkpoint.file_entries(staged, ["optimizer.rank1.pt", "experts/rank1.pt"])
    path = checkpoint.commit(tmp_path, 5, {"recipe": {}}, described)
    files = checkpoint.verify(path)["files"]
    assert set(files) == {"meta.json", "optimizer.rank0.pt", "optimizer.rank1.pt", "experts/rank0.pt", "experts/rank1.pt"}
    (path / "experts" / "rank1.pt").unlink()
    with pytest.raises(CheckpointError, match="experts/rank1.pt is missing"):
        checkpoint.verify(path)
    # a rank that described a file it never wrote cannot publish a checkpoint without it
    staged = checkpoint.staging_dir(tmp_path, 6)
    torch.save({}, staged / "optimizer.rank0.pt")
    with pytest.raises(CheckpointError, match="described files were never written: optimizer.rank1.pt"):
        checkpoint.commit(tmp_path, 6, {}, {"optimizer.rank1.pt": {"bytes": 1, "sha256": "0"}})


def test_prune_keeps_the_newest_and_leftovers_are_removed(tmp_path):
    for step in (1, 2, 10, 11):
        save(tmp_path, step)
    assert checkpoint.prune(tmp_path, 2) == ["step_0000002", "step_0000001"]  # by step number, not by name
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step_0000011", "step_0000010"]
    assert checkpoint.prune(tmp_path, 0) == []
    (tmp_path / ".tmp-step_0000012").mkdir()
    (tmp_path / ".tmp-step_0000012" / "model.safetensors").write_bytes(b"half")
    assert checkpoint.remove_leftovers(tmp_path) == [".tmp-step_0000012"]
    assert not (tmp_path / ".tmp-step_0000012").exists()


def test_a_failed_save_leaves_nothing(tmp_path):
    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle")

    with pytest.raises(RuntimeError, match="cannot pickle"):
        checkpoint.save_checkpoint(tmp_path, 1, torch.nn.Linear(2, 2), {"bad": Unpicklable()}, {})
    assert list(tmp_path.iterdir()) == []


def test_weight_mismatch_names_the_tensors(tmp_path):
    path = save(tmp_path, 1, torch.nn.Linear(4, 3))
    message = checkpoint.weight_mismatch(path, torch.nn.Linear(5, 3))
    assert message == "shapes differ: weight [3, 4] -> [3, 5]"
    renamed = checkpoint.weight_mismatch(path, torch.nn.Sequential(torch.nn.Linear(4, 3)))
    assert renamed == "not in the checkpoint: 0.weight, 0.bias; not in the model: bias, weight"
    assert checkpoint.weight_mismatch(path, torch.nn.Linear(4, 3)) is None


def test_recipe_changes_and_optimizer_state_by_name():
    assert checkpoint.recipe_changes({"train": {"lr": 0.003, "steps": 6}, "run": {"out_dir": "a"}},
                                     {"train": {"lr": 0.001, "steps": 6}, "run": {"out_dir": "b"}}) == ["train.lr 0.003 -> 0.001"]
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    full = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    full.step()
    saved, saved_names = full.state_dict(), checkpoint.optimizer_param_names(full, model)
    # train only the second layer now: its moments carry over by name, nothing is misassigned by position
    part = torch.optim.AdamW(model[1].parameters())
    names = checkpoint.optimizer_param_names(part, model)
    assert names == [["1.weight", "1.bias"]]
    assert checkpoint.load_optimizer(part, saved, saved_names, names) == 2
    assert torch.equal(part.state[model[1].weight]["exp_avg"], full.state[model[1].weight]["exp_avg"])
    assert checkpoint.load_optimizer(full, saved, saved_names, saved_names) is None
