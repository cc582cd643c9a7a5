"""Hugging Face hub ids (``org/name``) resolved from the local hub cache only.

The layout is the one ``huggingface_hub`` writes:
``<cache>/models--org--name/refs/main`` holds a commit hash and
``<cache>/models--org--name/snapshots/<hash>/`` the files. Nothing is ever
downloaded: pagedserve runs where only the local disk is trusted.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

# org/name as the hub allows them: no leading dot or slash, exactly one slash.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


class ModelNotFound(FileNotFoundError):
    """A model that is neither a folder nor in the local hub cache."""


def is_hub_id(name: str) -> bool:
    return bool(_HUB_ID.match(name)) and ".." not in name


def hub_cache_dir() -> Path:
    """``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def resolve_hub_id(repo_id: str, revision: str = "main") -> str:
    """The snapshot folder of ``repo_id`` at ``revision`` (a ref name or a commit hash)."""
    cache = hub_cache_dir()
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    hint = (f"{repo_id!r} is not in the local Hugging Face cache ({cache}); pagedserve never downloads. "
            f"Fetch it first (e.g. `huggingface-cli download {repo_id}`), set HF_HOME or HF_HUB_CACHE to the "
            "cache that holds it, or pass a local folder")
    if not repo.is_dir():
        raise ModelNotFound(hint)
    snapshots = repo / "snapshots"
    ref = repo / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    snap = snapshots / commit
    if not snap.is_dir():
        # No ref for this revision: accept the only snapshot there is, if one.
        found = sorted(p for p in snapshots.iterdir() if p.is_dir()) if snapshots.is_dir() else []
        if revision == "main" and len(found) == 1:
            snap = found[0]
        else:
            raise ModelNotFound(f"{hint} (found {repo}, but no snapshot for revision {revision!r})")
    if not (snap / "config.json").is_file():
        raise ModelNotFound(f"{snap} (the cached snapshot of {repo_id!r}) has no config.json: "
                            "an incomplete download?")
    return str(snap)
