"""The one reader of ``PAGEDSERVE_*`` environment variables. Flags read them
as their defaults (``config.add_engine_args``); the few settings that are not
flags (worker threads, the simulated cost model, addresses, keys) are read
here too, each through ``env``. No imports: every module may use it."""
from __future__ import annotations

import os
from typing import Any

PREFIX = "PAGEDSERVE_"


def env(name: str, default: Any = None) -> Any:
    """``PAGEDSERVE_<NAME>`` when set and non-empty, else ``default``."""
    v = os.environ.get(PREFIX + name)
    return default if v in (None, "") else v


def env_flag(name: str, default: bool | None) -> bool | None:
    v = env(name)
    return default if v is None else str(v).strip().lower() in ("1", "true", "yes", "on")


def env_int(name: str, default: int | None) -> int | None:
    v = env(name)
    return default if v is None else int(v)
