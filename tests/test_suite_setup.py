"""How the suite itself is set up for speed: the pytest plugins it loads (pyproject's addopts),."""

import sys

from _pytest.assertion.rewrite import AssertionRewritingHook


def test_only_the_pytest_plugins_the_suite_names_are_loaded(pytestconfig):
    manager = pytestconfig.pluginmanager
    # Autoloaded, anyio's, platformdirs', langsmith's and schemathesis's plugins would be there too.
    assert {dist.project_name for _, dist in manager.list_plugin_distinfo()} <= {"pytest-xdist", "pytest-trio", "hypothesis"}
    for name in ("xdist.plugin", "pytest_trio.plugin", "_hypothesis_pytestplugin"):
        assert manager.get_plugin(name) is not None, name


def test_hypothesis_is_imported_as_installed_not_rewritten_by_pytest():
    # pytest-trio imports it in every pytest process; rewritten, its asserts cost ~1 s each time.
    assert "hypothesis.core" in sys.modules
    assert not isinstance(sys.modules["hypothesis.core"].__loader__, AssertionRewritingHook)
