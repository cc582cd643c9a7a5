"""The frontend's tokenizer: the model folder's ``tokenizer.json`` through the
``tokenizers`` library, its special tokens and chat templates read as
transformers 5's ``AutoTokenizer`` reads them (``tokenizer_files``), chat
templates rendered as its ``apply_chat_template`` renders them
(``tokenizer_chat``). Same ids, text and prompts as ``AutoTokenizer`` for a
generic fast tokenizer, without transformers, which imports torch: the
frontend process stays free of the worker's libraries (issue 21).

``load`` falls back to transformers' ``AutoTokenizer`` (and so torch) only for
what this does not copy: no tokenizer.json (a slow, Python-only tokenizer),
``--tokenizer-mode slow``, a model-specific tokenizer class (transformers 5
rebuilds those from vocab and merges, e.g. LlamaTokenizer) or remote code."""
from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Tokenizer

from pagedserve.frontend.core.tokenizer_chat import render
from pagedserve.frontend.core.tokenizer_files import SPECIAL_ATTRS, Token, TokenizerFiles, read_tokenizer_files, token_text

log = logging.getLogger("pagedserve.frontend")


@dataclass(frozen=True)
class Encoded:
    """What ``tokenizer(text)`` returns, as far as the frontend reads it."""
    input_ids: list[int]


def _added(token: Token, special: bool) -> AddedToken:
    if isinstance(token, dict):
        fields = {k: token[k] for k in ("single_word", "lstrip", "rstrip", "normalized", "special") if k in token}
        fields["special"] = special or bool(fields.get("special", False))
        return AddedToken(str(token["content"]), **fields)
    return AddedToken(token, special=True)  # a plain string among the special tokens: special


class FrontendTokenizer:
    """The subset of a transformers fast tokenizer the frontend uses."""

    def __init__(self, files: TokenizerFiles) -> None:
        assert files.tokenizer_json is not None
        self.name_or_path = files.folder
        self._tok = Tokenizer.from_file(files.tokenizer_json)
        # transformers turns tokenizer.json's truncation and padding off for every call it makes.
        self._tok.no_truncation()
        self._tok.no_padding()
        self.chat_template: str | dict[str, str] | None = files.chat_template
        self.clean_up_tokenization_spaces = bool(files.config.get("clean_up_tokenization_spaces", False))
        self._special = {k: token_text(v) for k, v in files.special.items()}
        self._extra = [token_text(t) for t in files.extra_special]
        self._add_missing(files)
        self._tok.encode_special_tokens = bool(files.config.get("split_special_tokens", False))

    def _add_missing(self, files: TokenizerFiles) -> None:
        """As TokenizersBackend.__init__: the config's added tokens the backend lacks, then
        every named and extra special token not yet an added token."""
        known = {t.content for t in self._tok.get_added_tokens_decoder().values()}
        names = set(self._special.values())
        todo: list[AddedToken] = []
        for _, fields in sorted(files.added_tokens.items()):
            if fields.get("content") not in known:
                todo.append(_added(fields, fields.get("content") in names))
        for token in [*files.special.values(), *files.extra_special]:
            text = token_text(token)
            if text not in known and all(t.content != text for t in todo):
                todo.append(_added(token, text in names))
        if todo:
            self._tok.add_tokens(todo)

    # ------------------------------------------------------------ vocabulary and special tokens
    @property
    def backend_tokenizer(self) -> Tokenizer:
        return self._tok

    def __len__(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def vocab_size(self) -> int:
        """The base vocabulary, without added tokens (transformers' ``vocab_size``)."""
        return int(self._tok.get_vocab_size(with_added_tokens=False))

    def get_vocab(self) -> dict[str, int]:
        return dict(self._tok.get_vocab(with_added_tokens=True))

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens (not the extra ones), as transformers 5; the chat template sees them."""
        return dict(self._special)

    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys([*self._special.values(), *self._extra]))

    @property
    def all_special_ids(self) -> list[int]:
        return [i for i in (self.convert_tokens_to_ids(t) for t in self.all_special_tokens) if i is not None]

    def _named(self, attr: str) -> str | None:
        return self._special.get(attr)

    def __getattr__(self, name: str) -> Any:
        """bos_token, eos_token_id, pad_token, ... (None when the model names none)."""
        attr = name.removesuffix("_id")
        if attr in SPECIAL_ATTRS or attr in self.__dict__.get("_special", {}):
            token = self._special.get(attr)
            return token if attr == name or token is None else self.convert_tokens_to_ids(token)
        raise AttributeError(name)

    def convert_tokens_to_ids(self, tokens: str | Iterable[str]) -> Any:
        """An unknown token is the unk token's id (None without one), as transformers."""
        if isinstance(tokens, str):
            index = self._tok.token_to_id(tokens)
            if index is None:
                unk = self._special.get("unk_token")
                return None if unk is None else self._tok.token_to_id(unk)
            return int(index)
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: int | Iterable[int], skip_special_tokens: bool = False) -> Any:
        if isinstance(ids, int):
            return self._tok.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._tok.id_to_token(int(i)) for i in ids if int(i) not in skip]

    # ------------------------------------------------------------ encode and decode
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def __call__(self, text: str, add_special_tokens: bool = True) -> Encoded:
        return Encoded(self.encode(text, add_special_tokens))

    def decode(self, ids: int | Iterable[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None, **_: Any) -> str:
        """``spaces_between_special_tokens`` and the like are accepted and change nothing (as for
        transformers' fast tokenizers)."""
        ids = [ids] if isinstance(ids, int) else [int(i) for i in ids]
        text = str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))
        clean = self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None else clean_up_tokenization_spaces
        if clean and type(self._tok.model).__name__ != "BPE":  # transformers never cleans BPE output
            for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                         (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
                text = text.replace(a, b)
        return text

    # ------------------------------------------------------------ chat
    def get_chat_template(self, chat_template: str | None = None, tools: list[Any] | None = None) -> str:
        """transformers' choice: a named template, the tool_use one when tools are given, the default."""
        if isinstance(self.chat_template, dict):
            if chat_template is not None and chat_template in self.chat_template:
                return self.chat_template[chat_template]
            if chat_template is None:
                if tools is not None and "tool_use" in self.chat_template:
                    return self.chat_template["tool_use"]
                if "default" in self.chat_template:
                    return self.chat_template["default"]
                raise ValueError("This model has multiple chat templates with no default specified! Available "
                                 f"template names are {sorted(self.chat_template)}.")
            return chat_template
        if chat_template is not None:
            return chat_template
        if self.chat_template is None:
            raise ValueError("Cannot use chat template functions because tokenizer.chat_template is not set "
                             "and no template argument was passed!")
        return self.chat_template

    def apply_chat_template(self, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                            documents: list[dict[str, Any]] | None = None, chat_template: str | None = None,
                            add_generation_prompt: bool = False, continue_final_message: bool | str = False,
                            tokenize: bool = True, **kwargs: Any) -> str | list[int]:
        """transformers' apply_chat_template for one conversation; ``tokenize``: its
        ids (no special tokens added: the template wrote them)."""
        template = self.get_chat_template(chat_template, tools)
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not compatible.")
        text = render(template, conversation, tools, documents, add_generation_prompt, continue_final_message,
                      {**self._special, **kwargs})
        return self.encode(text, add_special_tokens=False) if tokenize else text


def load(folder: str, slow: bool = False, trust_remote_code: bool = False) -> Any:
    """The tokenizer of a model folder: a ``FrontendTokenizer`` when tokenizer.json
    describes it, else transformers' AutoTokenizer (imports torch: logged)."""
    files = read_tokenizer_files(folder)
    remote = trust_remote_code and "auto_map" in files.config
    if files.is_generic and not slow and not remote:
        return FrontendTokenizer(files)
    why = ("--tokenizer-mode slow" if slow else "remote code" if remote else "no tokenizer.json"
           if files.tokenizer_json is None else f"tokenizer class {files.tokenizer_class}")
    log.warning("tokenizer of %s loaded with transformers (%s): the frontend imports torch", folder, why)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, use_fast=not slow, trust_remote_code=trust_remote_code)
