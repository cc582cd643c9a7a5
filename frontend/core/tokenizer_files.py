"""What a model folder says about its tokenizer, read as transformers 5.x's
``AutoTokenizer`` reads it (tokenization_utils_base._from_pretrained), but
without transformers (which imports torch): ``tokenizer_config.json``, the
legacy ``special_tokens_map.json``, the chat templates (``chat_template.jinja``
and ``additional_chat_templates/*.jinja`` over the config's entry), and the
sampling fields of ``generation_config.json``."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# transformers' PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES, in its order.
SPECIAL_ATTRS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Classes whose tokenizer is tokenizer.json as it is (transformers 5 builds model-specific
# classes, e.g. LlamaTokenizer, again from vocab and merges, which this module does not copy).
GENERIC_CLASSES = (None, "TokenizersBackend", "PreTrainedTokenizerFast")

Token = str | dict[str, Any]  # a token's text, or an AddedToken's fields (content, special, lstrip, ...)


@dataclass
class TokenizerFiles:
    folder: str
    tokenizer_class: str | None
    config: dict[str, Any]  # tokenizer_config.json less what is read into the fields below
    special: dict[str, Token] = field(default_factory=dict)  # attribute (bos_token, image_token, ...) -> token
    extra_special: list[Token] = field(default_factory=list)  # extra_special_tokens (additional_special_tokens)
    added_tokens: dict[int, dict[str, Any]] = field(default_factory=dict)  # the config's added_tokens_decoder
    chat_template: str | dict[str, str] | None = None

    @property
    def tokenizer_json(self) -> str | None:
        path = os.path.join(self.folder, "tokenizer.json")
        return path if os.path.isfile(path) else None

    @property
    def is_generic(self) -> bool:
        """tokenizer.json alone describes the tokenizer transformers would build."""
        return self.tokenizer_json is not None and self.tokenizer_class in GENERIC_CLASSES


def _json(path: Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        value = json.load(f)
    return value if isinstance(value, dict) else {}


def _chat_templates(folder: Path, config: dict[str, Any]) -> str | dict[str, str] | None:
    """Template files win over the config's entry; one default: a string, several: a dict by name."""
    found: dict[str, str] = {}
    if (folder / "chat_template.jinja").is_file():
        found["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    extra = folder / "additional_chat_templates"
    if extra.is_dir():
        for f in sorted(extra.glob("*.jinja")):
            found[f.name.removesuffix(".jinja")] = f.read_text(encoding="utf-8")
    if list(found) == ["default"]:
        return found["default"]
    if found:
        return found
    value = config.get("chat_template")
    if isinstance(value, (list, tuple)):
        return {t["name"]: t["template"] for t in value}
    return value if isinstance(value, (str, dict)) else None


def read_tokenizer_files(folder: str) -> TokenizerFiles:
    root = Path(folder)
    config = _json(root / "tokenizer_config.json") if (root / "tokenizer_config.json").is_file() else {}
    tokenizer_class = config.pop("tokenizer_class", None)
    chat_template = _chat_templates(root, config)
    config.pop("chat_template", None)
    if "additional_special_tokens" in config and not config.get("extra_special_tokens"):
        config["extra_special_tokens"] = config.pop("additional_special_tokens")
    added = {int(k): v for k, v in (config.pop("added_tokens_decoder", None) or {}).items() if isinstance(v, dict)}
    if not added and (root / "special_tokens_map.json").is_file():
        # Legacy: the map's entries replace the config's (transformers reads it only without added_tokens_decoder).
        for key, value in _json(root / "special_tokens_map.json").items():
            if key == "extra_special_tokens" and isinstance(value, list):
                merged = list(config.get("extra_special_tokens") or [])
                merged += [t for t in value if t not in merged]
                value = merged
            elif isinstance(value, dict) and key != "extra_special_tokens":
                value = {**value, "special": True}
            config[key] = value
    # Model-specific named tokens (image_token, ...): attributes like bos_token, in special_tokens_map.
    special: dict[str, Token] = {}
    for key in list(config):
        value = config[key]
        if key in SPECIAL_ATTRS or (key.endswith("_token") and isinstance(value, (str, dict))):
            config.pop(key)
            if value is not None:
                special[key] = value
    extra = config.pop("extra_special_tokens", None) or []
    if isinstance(extra, dict):
        special.update(extra)
        extra = []
    ordered = {k: special[k] for k in SPECIAL_ATTRS if k in special}
    ordered.update({k: v for k, v in special.items() if k not in ordered})
    return TokenizerFiles(folder, tokenizer_class, config, ordered, list(extra), added, chat_template)


def token_text(token: Token) -> str:
    return str(token["content"]) if isinstance(token, dict) else str(token)


# ------------------------------------------------------------------ generation_config.json
def generation_file_values(folder: str, keys: tuple[str, ...]) -> dict[str, Any] | None:
    """``keys`` of the folder's generation_config.json that are set (transformers 5's
    GenerationConfig defaults them all to None, so to_diff_dict keeps exactly these);
    None when the folder has no generation_config.json (transformers then reads config.json)."""
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return None
    config = _json(path)
    return {k: config[k] for k in keys if config.get(k) is not None}
