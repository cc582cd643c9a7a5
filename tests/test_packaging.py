"""Every folder of Python source ships in the installed package. A non-editable
install (the image's) holds only the packages pyproject.toml lists, so a
subpackage missing there imports in the editable dev venv and fails in the
image (``frontend/openai_api/tool_parsers`` did: the image's frontend exited at start)."""
from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_source_folder_is_a_listed_package() -> None:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = {Path(d): name for name, d in cfg["package-dir"].items()}
    listed = set(cfg["packages"])
    assert set(dirs.values()) == listed, "package-dir and packages name the same packages"
    top = {d for d in dirs if len(d.parts) == 1}
    missing = []
    for folder in sorted(top):
        for sub in sorted({p.parent for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts}):
            rel = sub.relative_to(ROOT)
            if rel not in dirs:
                missing.append(str(rel))
    assert not missing, f"folders with Python source that no listed package installs: {missing}"
