"""The plugin manager: registration, statuses, duplicates, unknown names, targets, allow-list, autoload switch."""

from __future__ import annotations

import importlib
import importlib.metadata as md
import sys
import types

import pytest

from megaseq import hookspecs
from megaseq.errors import PluginError
from megaseq.hookspecs import hookimpl
from megaseq.plugins import Plugins
from megaseq.records import AttentionSpec, ComponentConfig, FFNSpec
from megaseq_testkit import env, fresh_plugins, registered


class Width(ComponentConfig):
    width: int = 4


class ProvidesIdentity:
    @hookimpl
    def megaseq_attention(self):
        return [AttentionSpec(name="identity", target="megaseq.builtins.sdpa:build", config=Width, summary="test")]


def test_builtins_registered_without_entry_points():
    plugins = fresh_plugins()
    assert plugins.names("attention") == ["sdpa"]
    assert plugins.names("ffn") == ["swiglu"]
    assert [(i.name, i.dist) for i in plugins] == [("megaseq.builtins", "megaseq-core"), ("megaseq.commands", "megaseq-core")]


def test_registered_context_adds_and_removes():
    plugins = fresh_plugins()
    with registered(ProvidesIdentity(), plugins, name="identity-plugin"):
        assert "identity" in plugins.names("attention")
        assert plugins.get("attention", "identity").plugin.name == "identity-plugin"
    assert "identity" not in plugins.names("attention")


def test_duplicate_names_are_listed_and_only_their_use_fails():
    plugins = fresh_plugins()
    plugins.register(ProvidesIdentity(), name="first", dist="dist-a", version="1.0")
    plugins.register(ProvidesIdentity(), name="second", dist="dist-b", version="2.0")
    with pytest.warns(UserWarning, match=r"'identity' is provided twice: by dist-a 1.0 \(first\) and by dist-b 2.0"):
        assert plugins.names("attention") == ["sdpa"]
    assert plugins.get("attention", "sdpa").plugin.dist == "megaseq-core"  # other names still work
    infos = {i.name: i for i in plugins}
    assert infos["first"].status == infos["second"].status == "active"
    assert infos["first"].components == infos["second"].components == {"attention": ["identity"]}
    assert infos["first"].conflicts == ["attention 'identity' is also provided by dist-b 2.0"]
    with pytest.raises(PluginError, match=r"r.toml: attention 'identity' is provided twice: by dist-a 1.0 .*set MEGASEQ_PLUGINS"):
        plugins.get("attention", "identity", where="r.toml")


def test_unknown_name_lists_choices_and_plugins():
    plugins = fresh_plugins()
    with pytest.raises(PluginError) as err:
        plugins.get("attention", "mamba", where="r.toml: model.layer_pattern[0]")
    msg = str(err.value)
    assert "r.toml: model.layer_pattern[0]: no attention named 'mamba'; available: sdpa" in msg
    assert "megaseq-core" in msg and "\n" not in msg and "provided by" not in msg


@pytest.mark.parametrize(("kind", "name"), [("attention", "my-attention"), ("moe", "my-moe")])
def test_unknown_name_says_to_install_its_plugin(kind, name):
    with pytest.raises(PluginError, match=f"no {kind} named '{name}'.*is the plugin that provides it installed"):
        fresh_plugins().get(kind, name)


def test_misspelt_targets_make_the_plugin_broken_with_the_reason():
    class MisspeltMemory:
        @hookimpl
        def megaseq_attention(self):
            return [AttentionSpec(name="x", target="megaseq.builtins.sdpa:build", memory="megaseq.builtins.sdpa:memory_estimat")]

    class MisspeltModule:
        @hookimpl
        def megaseq_attention(self):
            return [AttentionSpec(name="y", target="megaseq.builtins.sdpaa:build")]

    plugins = fresh_plugins()
    plugins.register(MisspeltMemory(), name="memory-typo", dist="dist-m", version="1")
    plugins.register(MisspeltModule(), name="module-typo", dist="dist-t", version="1")
    with pytest.warns(UserWarning, match="broken"):
        assert plugins.names("attention") == ["sdpa"]
    memory, module = plugins.infos["memory-typo"], plugins.infos["module-typo"]
    assert memory.status == "broken"
    assert memory.reason.startswith("attention 'x': memory 'megaseq.builtins.sdpa:memory_estimat': module megaseq.builtins.sdpa")
    assert memory.reason.endswith("defines no 'memory_estimat'")
    assert module.status == "broken"
    assert module.reason == "attention 'y': target 'megaseq.builtins.sdpaa:build': module 'megaseq.builtins.sdpaa' not found"
    assert "megaseq.builtins.sdpaa" not in sys.modules  # nothing was imported to find out


def test_misspelt_hook_fails_at_registration():
    class Misspelt:
        @hookimpl
        def megaseq_atention(self):
            return []

    with pytest.raises(PluginError, match="megaseq_atention"):
        fresh_plugins().register(Misspelt(), name="typo")


def test_broken_registration_hook_is_isolated_and_warned():
    class Broken:
        @hookimpl
        def megaseq_attention(self):
            raise RuntimeError("boom")

    plugins = fresh_plugins()
    plugins.register(Broken(), name="broken", dist="dist-broken", version="0.0.1")
    with pytest.warns(UserWarning, match=r"'broken' \(dist-broken 0.0.1\) is broken: megaseq_attention: RuntimeError: boom"):
        assert plugins.names("attention") == ["sdpa"]
    info = plugins.infos["broken"]
    assert info.status == "broken"
    with pytest.raises(PluginError, match=r"unavailable plugins: dist-broken 0.0.1 \(broken: .*boom\)"):
        plugins.get("attention", "anything")


def test_a_broken_plugins_lifecycle_hooks_never_run():
    calls = []

    class BrokenWithState:
        @hookimpl
        def megaseq_attention(self):
            raise RuntimeError("boom")

        @hookimpl
        def megaseq_step_end(self, step, model, metrics):
            calls.append("step_end")

        @hookimpl
        def megaseq_checkpoint_save(self, model):
            calls.append("checkpoint_save")
            return {"broken": 1}

    plugins = fresh_plugins()
    plugins.register(BrokenWithState(), name="broken")
    with pytest.warns(UserWarning, match="is broken"):
        plugins.names("attention")
    plugins.hooks.step_end(step=None, model=None, metrics={})
    assert plugins.hooks.checkpoint_save(model=None) == {}
    assert calls == [] and plugins.infos["broken"].status == "broken"
    plugins.unregister("broken")  # a blocked plugin can still be removed, and its name reused
    plugins.register(ProvidesIdentity(), name="broken")


def test_colliding_checkpoint_keys_name_both_plugins():
    def saver(key, value):
        class Saver:
            @hookimpl
            def megaseq_checkpoint_save(self, model):
                return {key: value}

        return Saver()

    plugins = fresh_plugins()
    plugins.register(saver("moe", 1), name="first")
    plugins.register(saver("own", 2), name="second")
    assert plugins.hooks.checkpoint_save(model=None) == {"moe": 1, "own": 2}
    plugins.register(saver("moe", 3), name="third")
    with pytest.raises(PluginError, match=r"plugins 'first' and 'third' both return the key 'moe'"):
        plugins.hooks.checkpoint_save(model=None)


def test_wrong_record_type_is_broken():
    class Wrong:
        @hookimpl
        def megaseq_attention(self):
            return [FFNSpec(name="x", target="a:b")]

    plugins = fresh_plugins()
    plugins.register(Wrong(), name="wrong")
    with pytest.warns(UserWarning, match="expected AttentionSpec"):
        plugins.registry  # noqa: B018
    assert plugins.infos["wrong"].status == "broken"


@pytest.fixture
def crashing_module(tmp_path, monkeypatch):
    """A module that defines ``build`` (so it passes the static check) and raises when imported."""
    (tmp_path / "megaseq_crash_on_import.py").write_text("raise RuntimeError('boom at import')\ndef build(): ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "megaseq_crash_on_import:build"


def test_target_import_failure_names_distribution(crashing_module):
    class BadTarget:
        @hookimpl
        def megaseq_attention(self):
            return [AttentionSpec(name="ghost", target=crashing_module)]

    plugins = fresh_plugins()
    plugins.register(BadTarget(), name="bad", dist="megaseq-ghost", version="0.3.0")
    with pytest.raises(PluginError, match=r"attention 'ghost' from megaseq-ghost 0.3.0 failed to load: RuntimeError: boom"):
        plugins.get("attention", "ghost").load()


def test_check_imports_every_target(crashing_module):
    class BadTarget:
        @hookimpl
        def megaseq_attention(self):
            return [AttentionSpec(name="ghost", target=crashing_module)]

    plugins = fresh_plugins()
    assert plugins.check() == []
    plugins.register(BadTarget(), name="bad", dist="megaseq-ghost", version="0.3.0")
    assert plugins.check() == [
        f"attention 'ghost' from megaseq-ghost 0.3.0: target '{crashing_module}': RuntimeError: boom at import"
    ]


def test_record_validation():
    with pytest.raises(ValueError, match="not 'module:attr'"):
        AttentionSpec(name="x", target="nocolon")
    with pytest.raises(ValueError, match="identifier"):
        AttentionSpec(name="bad name", target="a:b")
    with pytest.raises(ValueError, match="ComponentConfig"):
        AttentionSpec(name="x", target="a:b", config=dict)  # type: ignore[arg-type]


# --- entry points -----------------------------------------------------------------------------------


class FakeDist:
    def __init__(self, name: str, version: str, requires: list[str]) -> None:
        self.name, self.version, self.requires = name, version, requires


class FakeEntryPoint:
    def __init__(self, name: str, module: str, dist: FakeDist) -> None:
        self.name, self.module, self.dist = name, module, dist

    def load(self):
        return importlib.import_module(self.module)


def fake_entry_points(monkeypatch, specs):
    """Install fake ``megaseq`` entry points: ``specs`` = [(ep name, module, dist name, version, requires)]."""
    eps = [FakeEntryPoint(n, m, FakeDist(d, v, r)) for n, m, d, v, r in specs]
    monkeypatch.setattr(md, "entry_points", lambda group=None: eps if group == "megaseq" else [])


@pytest.fixture
def plugin_module(monkeypatch):
    module = types.ModuleType("fake_megaseq_plugin")

    @hookimpl
    def megaseq_attention():
        return [AttentionSpec(name="fake", target="fake_megaseq_plugin:build")]

    module.megaseq_attention = megaseq_attention
    module.build = lambda config, dims, layer_idx: None
    monkeypatch.setitem(sys.modules, "fake_megaseq_plugin", module)
    return module


def load(specs, monkeypatch) -> Plugins:
    fake_entry_points(monkeypatch, specs)
    plugins = Plugins()
    plugins.load_entrypoints()
    return plugins


def test_entry_point_statuses(monkeypatch, plugin_module):
    specs = [
        ("fake", "fake_megaseq_plugin", "megaseq-fake", "1.0", ["megaseq-core>=0.1,<0.2"]),
        ("old", "fake_megaseq_plugin", "megaseq-old", "0.1", ["megaseq-core<0.1"]),
        ("crash", "no_such_plugin_module_xyz", "megaseq-crash", "2.0", []),
    ]
    with pytest.warns(UserWarning, match="megaseq-crash 2.0"):
        plugins = load(specs, monkeypatch)
        status = {i.name: (i.status, i.reason) for i in plugins}
    assert status["fake"] == ("active", "")
    assert status["old"][0] == "incompatible" and "requires megaseq-core<0.1" in status["old"][1]
    assert status["crash"][0] == "broken" and "ModuleNotFoundError" in status["crash"][1]
    assert plugins.names("attention") == ["fake", "sdpa"]


def test_allow_list_and_autoload_switch(monkeypatch, plugin_module):
    specs = [("fake", "fake_megaseq_plugin", "megaseq-fake", "1.0", [])]
    with env(MEGASEQ_PLUGINS="something-else"):
        plugins = load(specs, monkeypatch)
    assert plugins.infos["fake"].status == "disabled" and "MEGASEQ_PLUGINS" in plugins.infos["fake"].reason
    with env(MEGASEQ_PLUGINS="megaseq-fake"):
        assert load(specs, monkeypatch).infos["fake"].status == "active"
    with env(MEGASEQ_DISABLE_PLUGIN_AUTOLOAD="1"):
        plugins = load(specs, monkeypatch)
    assert plugins.infos["fake"].status == "disabled"
    with pytest.raises(PluginError, match=r"megaseq-fake 1.0 \(disabled: MEGASEQ_DISABLE_PLUGIN_AUTOLOAD=1\)"):
        plugins.get("attention", "fake")


def test_active_list_for_headers():
    version = __import__("megaseq").__about__.__version__
    assert fresh_plugins().active() == [{"name": name, "dist": "megaseq-core", "version": version}
                                        for name in ("megaseq.builtins", "megaseq.commands")]


# --- governance: every hook is documented and exercised ----------------------------------------------


def test_every_hookspec_is_documented_and_prefixed():
    specs = [n for n in dir(hookspecs) if n.startswith("megaseq_")]
    assert len(specs) >= 9
    for name in specs:
        assert getattr(hookspecs, name).__doc__, f"hook {name} has no docstring"
    plugins = Plugins()
    assert sorted(h for h in dir(plugins.pm.hook) if not h.startswith("_")) == sorted(specs)
