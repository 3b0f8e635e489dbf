"""How the suite itself is set up for speed: the pytest plugins it loads (pyproject's addopts), and the module marks
that let the fast subset leave whole modules unimported (conftest.pytest_ignore_collect)."""

import collections
import sys

import pytest
from _pytest.assertion.rewrite import AssertionRewritingHook

# The marks the fast subset leaves out (conftest.py).
SUBSET_MARKS = frozenset({"real_model", "peers", "slow"})


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


def test_a_module_whose_every_test_has_a_subset_mark_declares_it_at_its_top(request):
    """Otherwise `-m "not X"` imports the module (its imports, pytest's rewriting of its asserts) only to deselect
    all of it. Checked over the whole suite's items, so only a run that collects them all can check it."""
    options = request.config.option
    if options.markexpr or options.keyword or options.deselect:
        pytest.skip("needs the whole suite collected: run without -m, -k or --deselect")
    marks = collections.defaultdict(list)  # a module -> each of its tests' subset marks
    for item in request.session.items:
        marks[item.getparent(pytest.Module)].append({mark.name for mark in item.iter_markers()} & SUBSET_MARKS)
    if len(marks) < 2:
        pytest.skip("needs the whole suite collected: this module alone says nothing")
    undeclared = {
        module.path.name: sorted(shared - {mark.name for mark in module.own_markers})
        for module, each in marks.items()
        if (shared := set.intersection(*each)) - {mark.name for mark in module.own_markers}
    }
    assert undeclared == {}
