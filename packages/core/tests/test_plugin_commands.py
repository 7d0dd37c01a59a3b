"""Commands that plugins add to the ``megaseq`` command line (hook ``megaseq_command``)."""

from __future__ import annotations

import sys
import types

import pytest

import megaseq.plugins
from megaseq import cli
from megaseq.errors import UserError
from megaseq.hookspecs import hookimpl
from megaseq.records import CommandSpec
from megaseq_testkit import fresh_plugins

calls: list[list[str]] = []


def hello_main(argv: list[str]) -> int:
    if argv == ["--fail"]:
        raise UserError("hello: --fail was given")
    calls.append(argv)
    return 3


commands_module = types.ModuleType("megaseq_cli_test_commands")
commands_module.hello_main = hello_main
sys.modules[commands_module.__name__] = commands_module


class HelloPlugin:
    def __init__(self, name: str = "hello") -> None:
        self.name = name

    @hookimpl
    def megaseq_command(self):
        return [CommandSpec(name=self.name, target="megaseq_cli_test_commands:hello_main", summary="say hello")]


@pytest.fixture
def with_plugins(monkeypatch):
    def install(*plugin_objects):
        plugins = fresh_plugins()
        for i, obj in enumerate(plugin_objects):
            plugins.register(obj, name=f"p{i}")
        monkeypatch.setattr(megaseq.plugins, "get_plugins", lambda: plugins)
        return plugins

    calls.clear()
    return install


def test_dispatches_arguments_and_exit_status(with_plugins):
    with_plugins(HelloPlugin())
    assert cli.main(["hello", "a", "--flag", "-x"]) == 3
    assert calls == [["a", "--flag", "-x"]]


def test_user_error_is_one_line_exit_2(with_plugins, capsys):
    with_plugins(HelloPlugin())
    assert cli.main(["hello", "--fail"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["megaseq: error: hello: --fail was given"]


def test_listed_in_help(with_plugins, capsys):
    with_plugins(HelloPlugin())
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "hello" in out and "say hello" in out


def test_core_command_names_stay_cores(with_plugins, capsys, tmp_path):
    with_plugins(HelloPlugin("train"))
    assert cli.main(["train", str(tmp_path / "missing.toml")]) == 2  # core's train ran: recipe not found
    assert calls == []
    assert "megaseq: warning: command 'train' from (local)  is ignored: core's own 'train' runs" in capsys.readouterr().err


def test_two_providers_are_an_error(with_plugins, capsys):
    with_plugins(HelloPlugin(), HelloPlugin())
    assert cli.main(["hello"]) == 2
    err = capsys.readouterr().err
    assert "provided twice" in err and calls == []


def test_unknown_command_still_lists_choices(with_plugins, capsys):
    with_plugins(HelloPlugin())
    assert cli.main(["helo"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "unknown command 'helo'" in line and "hello" in line


def test_core_commands_are_records_of_the_command_hook(with_plugins):
    """Core's commands are registered by its built-in plugin through ``megaseq_command``, like a plugin's."""
    plugins = with_plugins()
    core = {name for name, provided in plugins.registry["command"].items() if provided.plugin.dist == "megaseq-core"}
    assert core == {"train", "plan", "eval", "import", "export", "checkpoint", "plugins", "data"}
    for name in core:
        assert plugins.registry["command"][name].spec.target.startswith("megaseq.commands.")
