"""pyproject's package list names every package of the source tree (setuptools' automatic discovery cannot
also map configs/ into the wheel as mate.configs, so the list is written out; this keeps it complete)."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_ships():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {".".join(p.parent.relative_to(ROOT).parts) for top in ("mate", "tuning") for p in (ROOT / top).rglob("__init__.py")}
    assert found, "no packages found"
    mapped = set(setuptools["package-dir"])  # mate.configs = configs/, the tile configs
    assert set(setuptools["packages"]) == found | mapped
    assert all((ROOT / d).is_dir() for d in setuptools["package-dir"].values())
