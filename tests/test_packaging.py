"""pyproject's package list names every package of the source tree (setuptools' automatic discovery cannot
also map configs/ into the wheel as mate.configs, so the list is written out; this keeps it complete), and the
wheel installs one top-level package, `mate` (the tuner is mate.tuning, so `import tuning` is not ours)."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_ships():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "mate").rglob("__init__.py")}
    assert found, "no packages found"
    mapped = set(setuptools["package-dir"])  # mate.configs = configs/, the tile configs
    assert set(setuptools["packages"]) == found | mapped
    assert all((ROOT / d).is_dir() for d in setuptools["package-dir"].values())


def test_the_wheel_installs_only_mate():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert {p.split(".")[0] for p in setuptools["packages"]} == {"mate"}
    assert not (ROOT / "tuning").exists()
    # The commands' modules are in the package.
    assert project["scripts"] == {"mate-tune": "mate.tuning.cli:main", "mate-precompile": "mate.precompile:main"}
