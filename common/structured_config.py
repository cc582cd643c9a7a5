"""``--structured-outputs-config``: vLLM 0.32's StructuredOutputsConfig as a
JSON object (vllm/config/structured_outputs.py), with the keys and refusals
vLLM has. The worker compiles with it (the JSON whitespace of every request);
every component parses the flag, so a bad value stops them all at start-up.

Only the xgrammar backend exists here: ``backend`` "auto" (vLLM's default)
and "xgrammar" both mean it; another backend is refused. Where vLLM wants
``backend: xgrammar`` next to ``disable_any_whitespace``, "auto" is accepted
too, since here it is xgrammar. ``disable_additional_properties`` is vLLM's
guidance-only option and is refused as vLLM refuses it (xgrammar's strict
mode already keeps out properties a schema does not name). No reasoning
parsers exist, so the reasoning keys take only their defaults."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from pagedserve.common.flag_json import config_object
from pagedserve.common.flag_json import flag_error as _fail

_BACKENDS = ("auto", "xgrammar")
_VLLM_BACKENDS = ("guidance", "outlines", "lm-format-enforcer")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    backend: str = "auto"
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    reasoning_parser: str = ""
    reasoning_parser_plugin: str = ""
    enable_in_reasoning: bool = False

    def __str__(self) -> str:
        """The flag's JSON (the keys that differ from the defaults), so engine_argv hands it on."""
        d = StructuredOutputsConfig()
        return json.dumps({f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                           if getattr(self, f.name) != getattr(d, f.name)}, sort_keys=True)


def parse_structured_outputs_config(text: str) -> StructuredOutputsConfig:
    """The flag's value; raises ``argparse.ArgumentTypeError`` (a one-line exit 2) on a bad one."""
    raw, fields = config_object(text, StructuredOutputsConfig, '{"disable_any_whitespace": true}')
    for key, value in raw.items():
        want = bool if isinstance(fields[key].default, bool) else str
        if not isinstance(value, want):
            raise _fail(f"{key} must be a {'boolean' if want is bool else 'string'}, got {value!r}")
    cfg = StructuredOutputsConfig(**raw)
    if cfg.backend not in _BACKENDS:
        known = f"vLLM's {cfg.backend} backend is not available" if cfg.backend in _VLLM_BACKENDS else \
            f"unknown backend {cfg.backend!r}"
        raise _fail(f"{known}; only xgrammar is (backend auto or xgrammar)")
    if cfg.disable_additional_properties:
        raise _fail("disable_additional_properties is only supported for the guidance backend (as in vLLM); "
                    "xgrammar's strict mode already refuses properties a schema does not name")
    if cfg.reasoning_parser or cfg.reasoning_parser_plugin or cfg.enable_in_reasoning:
        raise _fail("reasoning parsers are not supported")
    return cfg
