"""``--kv-events-config``: vLLM 0.32's KVEventsConfig as a JSON object
(vllm/config/kv_events.py), with its keys and defaults but one: the default
endpoint binds loopback (``tcp://127.0.0.1:5557``) where vLLM's binds every
interface (``tcp://*:5557``), as every internal socket here does; a
deployment that feeds a router on another host passes ``tcp://*:5557``.

The blockmgr publishes (blockmgr/kv_events.py); every component parses the
flag, so a bad value stops them all at start-up."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from pagedserve.common.flag_json import config_object
from pagedserve.common.flag_json import flag_error as _fail

_PUBLISHERS = ("null", "zmq")
_ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = ""  # "": vLLM's None, resolved as vLLM does (zmq when enabled, else null)
    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.resolved_publisher == "zmq"

    @property
    def resolved_publisher(self) -> str:
        return self.publisher or ("zmq" if self.enable_kv_cache_events else "null")

    def __str__(self) -> str:
        """The flag's JSON (keys that differ from the defaults), so engine_argv hands it on."""
        d = KVEventsConfig()
        return json.dumps({f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                           if getattr(self, f.name) != getattr(d, f.name)}, sort_keys=True)


def _check_endpoint(key: str, value: str) -> None:
    if not value.startswith(_ENDPOINT_SCHEMES) or len(value) > 512:
        raise _fail(f"{key} must be a ZeroMQ endpoint (tcp://, ipc:// or inproc://), got {value[:80]!r}")


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """The flag's value; raises ``argparse.ArgumentTypeError`` (a one-line exit 2) on a bad one."""
    raw, fields = config_object(text, KVEventsConfig, '{"enable_kv_cache_events": true}')
    values: dict[str, object] = {}
    for key, value in raw.items():
        default = fields[key].default
        if key == "publisher" and value is None:
            continue  # vLLM's own default spelling
        if key == "replay_endpoint":
            if value is not None and not isinstance(value, str):
                raise _fail("replay_endpoint must be a string or null")
        elif isinstance(default, bool):
            if not isinstance(value, bool):
                raise _fail(f"{key} must be true or false")
        elif isinstance(default, int):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 10_000_000:
                raise _fail(f"{key} must be an integer in [1, 10000000]")
        elif not isinstance(value, str):
            raise _fail(f"{key} must be a string")
        values[key] = value
    cfg = KVEventsConfig(**values)  # type: ignore[arg-type]
    if cfg.resolved_publisher not in _PUBLISHERS:
        raise _fail(f"unknown event publisher {cfg.publisher!r} (zmq or null)")
    if len(cfg.topic) > 256:
        raise _fail("topic: at most 256 characters")
    _check_endpoint("endpoint", cfg.endpoint)
    if cfg.replay_endpoint is not None:
        _check_endpoint("replay_endpoint", cfg.replay_endpoint)
    return cfg
