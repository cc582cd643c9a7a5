"""A fresh $PAGEDSERVE_CACHE for a test that must not see converted models, sharing the
compiled CPU kernels: the kernels' folder is keyed by the hash of their sources, compiler and
CPU (kernels/cpu_build.py) and written by atomic rename, so sharing it is safe, and a fresh one
would compile them again (about 20 s on two cores, per test)."""
from __future__ import annotations

import os
from pathlib import Path

# Computed at import, before any test points $PAGEDSERVE_CACHE elsewhere.
SHARED_KERNELS = Path(os.environ.get("PAGEDSERVE_CACHE") or Path.home() / ".cache" / "pagedserve") / "kernels"


def fresh_cache(path: Path) -> str:
    """Makes ``path`` a cache with nothing in it but a link to the shared kernels; returns it."""
    path.mkdir(parents=True, exist_ok=True)
    SHARED_KERNELS.mkdir(parents=True, exist_ok=True)
    link = path / "kernels"
    if not link.exists():
        link.symlink_to(SHARED_KERNELS, target_is_directory=True)
    return str(path)
