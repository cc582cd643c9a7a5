"""pagedserve: an LLM serving engine built on PagedAttention."""
from __future__ import annotations

import os
import sys

__version__ = "0.1.0"


def _leave_the_source_root_off_sys_path() -> None:
    """``python -m`` run in the repository's root puts that folder on sys.path,
    and there its top-level ``kernels/`` folder (installed as
    ``pagedserve.kernels``) would shadow the ``kernels`` package that
    transformers (a dependency of it since 5.25) imports. pagedserve is
    installed, so nothing of ours is imported through that entry."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.isfile(os.path.join(root, "kernels", "cpu_build.py")):
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]


_leave_the_source_root_off_sys_path()
