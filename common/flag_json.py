"""The JSON-object flags modelled on vLLM's config classes (``--structured-outputs-config``,
``--kv-events-config``): the checks every one of them makes before its own."""
from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

MAX_CONFIG_CHARS = 4096


def flag_error(why: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(why)  # argparse names the flag: a one-line exit 2


def config_object(text: str, cls: type, example: str) -> tuple[dict[str, Any], dict[str, dataclasses.Field[Any]]]:
    """The flag's JSON object (bounded, a dict, only ``cls``'s field names) and ``cls``'s fields."""
    if len(text) > MAX_CONFIG_CHARS:
        raise flag_error(f"at most {MAX_CONFIG_CHARS} characters")
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise flag_error(f"not a JSON object ({e})") from None
    if not isinstance(raw, dict):
        raise flag_error(f"must be a JSON object, e.g. '{example}'")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            raise flag_error(f"unknown key {key!r} (known: {', '.join(fields)})")
    return raw, fields
