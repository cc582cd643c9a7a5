"""A ``vllm serve`` command line read as vLLM's ``FlexibleArgumentParser`` reads
it, before argparse sees it: ``--config FILE.yaml`` (its flags spliced in where
vLLM splices them, so the command line's own flags win), ``--flag_name`` as
``--flag-name``, ``-O3`` as ``--optimization-level 3``, and dotted JSON flags
(``--compilation-config.mode 3``) merged into one JSON value."""
from __future__ import annotations

import json
import re
from typing import Any

_KEY = re.compile(r"(?<=--)[^.]*")
MAX_CONFIG_BYTES = 1 << 20


class ArgvError(ValueError):
    """A command line or config file vLLM would not take either; the message is one line."""


def load_config_file(path: str, negatable: set[str]) -> list[str]:
    """vLLM's ``load_config_file``: a YAML mapping of flag names (dashes or underscores, no leading
    dashes) to values; true is the flag, false its ``--no-`` form where there is one, a list
    its items, a mapping JSON."""
    if path.rsplit(".", 1)[-1] not in ("yaml", "yml"):
        raise ArgvError(f"--config {path}: the config file must be a .yaml or .yml file")
    import yaml

    try:
        with open(path, "rb") as f:
            text = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ArgvError(f"--config {path}: {e.strerror}") from None
    if len(text) > MAX_CONFIG_BYTES:
        raise ArgvError(f"--config {path}: at most {MAX_CONFIG_BYTES} bytes")
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ArgvError(f"--config {path}: not YAML: {' '.join(str(e).split())}") from None
    if config is None:
        return []
    if not isinstance(config, dict):
        raise ArgvError(f"--config {path}: a mapping of flag names to values expected")
    out: list[str] = []
    for key, value in config.items():
        flag = "--" + str(key)
        if isinstance(value, bool):
            if value:
                out.append(flag)
            elif "--no-" + str(key).replace("_", "-") in negatable:
                out.append("--no-" + str(key))
        elif isinstance(value, list):
            if value:
                out += [flag, *map(str, value)]
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


def _splice_config(argv: list[str], negatable: set[str]) -> list[str]:
    at = [i for i, a in enumerate(argv) if a == "--config" or a.startswith("--config=")]
    if not at:
        return argv
    if len(at) > 1:
        raise ArgvError("--config: more than one config file given")
    i = at[0]
    if argv[i] == "--config":
        if i + 1 >= len(argv):
            raise ArgvError("--config: expected a YAML file")
        path, rest = argv[i + 1], argv[:i] + argv[i + 2:]
    else:
        path, rest = argv[i].split("=", 1)[1], argv[:i] + argv[i + 1:]
    from_file = load_config_file(path, negatable)
    # vLLM: a positional model stays first; the file's flags come before the command line's.
    if rest and not rest[0].startswith("-"):
        return [rest[0], *from_file, *rest[1:]]
    return [*from_file, *rest]


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def normalize(argv: list[str], negatable: set[str]) -> list[str]:
    """The command line as vLLM's parser would hand it to argparse."""
    argv = _splice_config(list(argv), negatable)
    out: list[str] = []
    for i, a in enumerate(argv):
        if a.startswith("--"):
            key, eq, value = a.partition("=")
            out.append(_KEY.sub(lambda m: m.group(0).replace("_", "-"), key, count=1) + eq + value)
        elif a.startswith("-O") and a != "-O":
            out += ["--optimization-level", a[3:] if a[2:3] == "=" else a[2:]]
        elif a == "-O" and i + 1 < len(argv) and argv[i + 1] in ("0", "1", "2", "3"):
            out.append("--optimization-level")
        else:
            out.append(a)
    # --name.key value (or --name.key=value): merged into --name '{"key": value}'
    merged: dict[str, dict[str, Any]] = {}
    kept: list[str] = []
    skip = False
    for i, a in enumerate(out):
        if skip:
            skip = False
            continue
        head = a.split("=", 1)[0]
        if not (a.startswith("--") and "." in head):
            kept.append(a)
            continue
        if "=" in a:
            head, text = a.split("=", 1)
        elif i + 1 < len(out):
            text, skip = out[i + 1], True
        else:
            raise ArgvError(f"{a}: expected a value")
        name, *keys = head.split(".")
        node = merged.setdefault(name, {})
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = _value(text)
    for name, value in merged.items():
        kept += [name, json.dumps(value)]
    return kept


def human_readable_int(text: str) -> int:
    """vLLM's type of --max-num-batched-tokens: 1k = 1000, 1K = 1024, 25.6k = 25600."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", text.strip())
    if not m:
        return int(text)
    number, suffix = m.groups()
    if suffix.islower():
        return int(float(number) * 1000 ** ("kmgt".index(suffix) + 1))
    if "." in number:
        raise ValueError(f"decimals are not allowed with binary suffixes like {suffix}")
    return int(number) * 1024 ** ("KMGT".index(suffix) + 1)


def model_len(text: str) -> int | None:
    """vLLM's type of --max-model-len: human_readable_int, or -1 / auto (here: the model's own length)."""
    return None if text.strip() in ("-1", "auto", "AUTO", "Auto") else human_readable_int(text)
