"""The plugin registry: one PluginManager per runtime, lazy entry points, the allow-list, describe()."""

from __future__ import annotations

import importlib.metadata
import logging
import sys
import textwrap

import pytest

from corral.hookspecs import hookimpl
from corral.plugins.architectures.gemma3 import Gemma3Model
from corral.plugins.architectures.llama import LlamaModel
from corral.plugins.backends.torch import TorchBackend
from corral.registry import ALLOW_ENV, Plugins

pytestmark = pytest.mark.usefixtures("no_allow_list_from_the_environment")

BUILT_INS = {"llama", "gemma3", "torch"}


class ToyModel:
    """Stands in for an architecture class; the registry never instantiates it."""


class ToyPlugin:
    def __init__(self, architecture: str = "toy", model: type = ToyModel):
        self.architecture, self.model = architecture, model

    @hookimpl
    def register_architectures(self, register):
        register(self.architecture, self.model)


def install_distribution(root, dist: str, version: str, entry_point: str, module: str, source: str) -> None:
    """Lay out an installed distribution (dist-info with a `corral` entry point) and its module under root."""
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[corral]\n{entry_point} = {module}\n")
    (root / f"{module}.py").write_text(textwrap.dedent(source))


FAKE_PLUGIN = """
    from corral.hookspecs import hookimpl

    class FakeModel:
        pass

    @hookimpl
    def register_architectures(register):
        register("fake", FakeModel)
"""


@pytest.fixture
def fake_distribution(tmp_path, monkeypatch) -> str:
    """An installed third-party distribution `corral-fake` 1.2.3 whose entry point `fake` adds architecture "fake"."""
    module = "corral_fake_arch"
    install_distribution(tmp_path, "corral-fake", "1.2.3", "fake", module, FAKE_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield module
    sys.modules.pop(module, None)


def test_builtin_plugins_register_through_entry_points():
    plugins = Plugins()
    architectures = plugins.architectures()
    assert (architectures["llama"], architectures["gemma3"]) == (LlamaModel, Gemma3Model)
    assert plugins.backends()["torch"] is TorchBackend


def test_creating_plugins_imports_no_plugin_until_first_use(fake_distribution):
    plugins = Plugins()
    assert fake_distribution not in sys.modules
    assert plugins.architectures()["fake"].__module__ == fake_distribution
    assert fake_distribution in sys.modules


def test_registering_into_one_runtime_leaves_another_untouched():
    first, second = Plugins(), Plugins()
    first.register(ToyPlugin(), name="toy")
    assert first.architectures()["toy"] is ToyModel
    assert "toy" not in second.architectures()


def test_unregister_removes_the_plugin_registrations():
    plugins = Plugins()
    plugins.register(ToyPlugin(), name="toy")
    plugins.unregister("toy")
    assert "toy" not in plugins.architectures()


def test_later_plugin_overrides_a_builtin_architecture():
    class CustomLlama:
        pass

    plugins = Plugins()
    plugins.register(ToyPlugin("llama", CustomLlama), name="custom-llama")
    assert plugins.architectures()["llama"] is CustomLlama
    plugins.unregister("custom-llama")
    assert plugins.architectures()["llama"] is LlamaModel


def test_allow_list_loads_only_the_named_plugins(fake_distribution):
    plugins = Plugins(allow=frozenset({"torch", "gemma3"}))
    assert set(plugins.architectures()) == {"gemma3"}
    assert set(plugins.backends()) == {"torch"}
    assert fake_distribution not in sys.modules


def test_allow_list_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv(ALLOW_ENV, "torch, llama")
    plugins = Plugins()
    assert set(plugins.architectures()) == {"llama"}


def test_allow_list_accepts_a_distribution_name(fake_distribution):
    plugins = Plugins(allow=frozenset({"corral-fake"}))
    assert set(plugins.architectures()) == {"fake"}
    assert plugins.backends() == {}


def test_empty_allow_list_loads_nothing():
    plugins = Plugins(allow=frozenset())
    assert plugins.architectures() == {} and plugins.backends() == {}


def test_plugin_that_fails_to_import_is_skipped_and_logged(tmp_path, monkeypatch, caplog):
    install_distribution(tmp_path, "corral-broken", "0.0.1", "broken", "corral_broken_arch", "raise ImportError\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with caplog.at_level(logging.ERROR, logger="corral.registry"):
        architectures = Plugins().architectures()
    assert {"llama", "gemma3"} <= set(architectures)
    assert "broken" in caplog.text and "corral-broken" in caplog.text


def test_describe_lists_the_builtins_with_distribution_version_and_registrations():
    infos = {info.name: info for info in Plugins().describe()}
    version = importlib.metadata.version("corral")
    assert {(name, infos[name].distribution, infos[name].version) for name in BUILT_INS} == {
        (name, "corral", version) for name in BUILT_INS
    }
    assert infos["llama"].registers == {"architectures": ("llama",)}
    assert infos["gemma3"].registers == {"architectures": ("gemma3",)}
    assert infos["torch"].registers == {"backends": ("torch",)}


def test_describe_names_a_third_party_distribution(fake_distribution):
    infos = {info.name: info for info in Plugins().describe()}
    assert (infos["fake"].distribution, infos["fake"].version) == ("corral-fake", "1.2.3")
    assert infos["fake"].registers == {"architectures": ("fake",)}


def test_describe_shows_a_hand_registered_plugin_without_distribution():
    plugins = Plugins()
    plugins.register(ToyPlugin(), name="toy")
    infos = {info.name: info for info in plugins.describe()}
    assert (infos["toy"].distribution, infos["toy"].version) == (None, None)
    assert infos["toy"].registers == {"architectures": ("toy",)}
