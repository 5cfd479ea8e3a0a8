"""A wheel (``pip install .``, not editable) must hold every package: pyproject lists them by hand
because the package folders (sim/, kernels/, calibration/) are mapped under ``servesim``."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_folder_is_listed_in_pyproject():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    mapped = {folder: name for name, folder in cfg["package-dir"].items()}
    found = set()
    for folder, name in mapped.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]))
    assert found, "no package folders found"
    assert found <= listed, f"packages missing from pyproject.toml [tool.setuptools] packages: {sorted(found - listed)}"
    assert listed <= found, f"pyproject lists packages with no folder: {sorted(listed - found)}"
