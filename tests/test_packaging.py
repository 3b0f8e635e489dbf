"""The install a newcomer runs: the README's two set-up commands, CI running exactly those, every import declared."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _readme_commands():
    spec = importlib.util.spec_from_file_location("readme_commands", ROOT / ".ci" / "readme_commands.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.setup_commands((ROOT / "README.md").read_text(encoding="utf-8"))


def test_the_readme_has_exactly_two_setup_commands():
    assert len(_readme_commands()) == 2


def test_the_first_command_installs_without_extras_and_runs_smollm2():
    run = _readme_commands()[0]
    steps = [step.strip() for step in run.split("&&")]
    assert "pip install torch==2.13.0" in steps, "the CPU wheel must come first, or pip pulls a CUDA build"
    assert steps.index("pip install torch==2.13.0") < steps.index("pip install -e .")
    assert re.fullmatch(r'corral run smollm2 "[^"]+"', steps[-1])


def test_the_second_command_installs_the_test_extras_and_runs_the_suite():
    steps = [step.strip() for step in _readme_commands()[1].split("&&")]
    assert "pip install torch==2.13.0" in steps
    assert any(step.startswith('pip install -e ".[test]"') for step in steps)
    assert steps[-1].startswith("python -m pytest")


def test_ci_runs_the_readmes_commands_as_written():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "readme_commands.py run)" in ci and "readme_commands.py test)" in ci
    assert 'bash -c "$run_model"' in ci and 'bash -c "$run_tests"' in ci
    code = [line for line in ci.splitlines() if not line.lstrip().startswith("#")]
    installs = re.compile(r"^\s*(python3? -m )?pip3? install")
    assert not any(installs.match(line) for line in code), "CI installs only through the README's commands"


@pytest.mark.slow  # runs deptry over the package
def test_every_runtime_import_is_a_declared_dependency():
    # deptry reads [tool.deptry] in pyproject.toml: missing, transitive, misplaced and unused dependencies.
    result = subprocess.run(
        [sys.executable, "-m", "deptry", "core", "plugins"], cwd=ROOT, capture_output=True, text=True,
        env={"NO_COLOR": "1", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_wheel_would_hold_every_package_and_kernel_source():
    """Every folder of modules under core/ and plugins/ is a listed package, and every non-Python file the
    code reads (kernel sources, templates, the chat page) is package data: a non-editable install has them."""
    import fnmatch
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    roots = {"core": "corral", "plugins": "corral.plugins"}
    found = {
        ".".join([roots[init.relative_to(ROOT).parts[0]], *init.parent.relative_to(ROOT / init.relative_to(ROOT).parts[0]).parts])
        for top in roots
        for init in (ROOT / top).rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    assert found <= set(setuptools["packages"]), sorted(found - set(setuptools["packages"]))
    data = setuptools["package-data"]
    for package, folder in (("corral.plugins.backends.torch", ROOT / "plugins/backends/torch"), ("corral.server", ROOT / "core/server")):
        files = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.suffix in (".c", ".h", ".js", ".css", ".html")]
        missing = [f for f in files if not any(fnmatch.fnmatch(f, pattern) for pattern in data[package])]
        assert not missing, (package, missing)


def test_corral_ray_without_ray_says_which_extra_to_install():
    # ray and starlette are the optional `ray` extra (deptry's exception in pyproject): a base install lacks them.
    code = "import sys; sys.modules['ray'] = None\ntry:\n    import corral.ray\nexcept ImportError as e:\n    print(e)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert 'pip install "corral[ray]"' in done.stdout, done.stdout + done.stderr
