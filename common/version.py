"""The installed pagedserve's version, for ``--version`` and the frontend's ``/version``.
In common (not the CLI layer) so the frontend can answer it without importing the CLI."""
from __future__ import annotations

from importlib import metadata


def version() -> str:
    try:
        return metadata.version("pagedserve")
    except metadata.PackageNotFoundError:  # a source tree that is not installed
        return "0+unknown"
