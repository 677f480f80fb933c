"""What a kvbridge runner is told to do: :class:`RunnerSettings`.

A vLLM stage receives it in its ``kv_transfer_config``, as
``kv_connector_extra_config["kvbridge"]``: the one engine argument a stock ``vllm serve``
needs (the pipeline's resolver builds the dict from the YAML stage config;
:func:`engine_kwargs` in :mod:`vllm_kvbridge.runner.worker` puts it there).
``additional_config["kvbridge"]`` is read too, for engines started that way. A non-vLLM runner (the diffusion
runner) builds it with :meth:`RunnerSettings.from_dict` too. The dict, every key optional::

    {
      "stage_id": 0,                       # int or [A-Za-z0-9_-] string
      "kv_transfer": {...},                # vllm_kvbridge.kv.config.KVTransferConfig.from_dict
      "kv_send": {                         # when the AR runner sends a request's KV
        "trigger": "on_finish",            # | "prefill_finished" | "special_token"
        "trigger_token_id": null,          # required with "special_token"
        "stop_after_transfer": false,      # only with "prefill_finished": finish after the prompt
      },
      "runner_cls": null,                  # "pkg.mod.Class": a subclass of the AR runner in use
      "payload": {
        "capture_hidden_states": false,    # AR runner: per-token final-norm hidden states
        "capture_token_ids": true,         # AR runner: sampled token ids
        "replace_keys": [],                # keys whose latest value replaces the previous one;
                                           # every other tensor key is concatenated on dim 0
        "custom_process_next_stage_input_func": null,   # "pkg.mod.func" or "pkg.mod:func"
        "outputs": [                       # edges this stage sends payloads on
          {"to_stage": 1, "mode": "full",  # | "async_chunk"
           "connector": "SharedMemoryConnector", "connector_config": {},
           "chunk_size": 16, "send_retries": 3,
           "send_timeout_s": 60.0}         # longest wait for room on a full edge per put
        ],
        "inputs": [                        # edges this stage receives payloads on
          {"from_stage": 0, "mode": "full",
           "connector": "SharedMemoryConnector", "connector_config": {},
           "recv_timeout_s": 30.0,         # full payload: deadline from expect() to arrival
           "stall_timeout_s": 30.0,        # async chunk: longest gap between two chunks
           "feed": "prompt_embeds"}        # | "per_step": rows condition the model per position
        ]
      }
    }

Unknown keys raise :class:`~vllm_kvbridge.errors.ConfigError` naming the key path
(``kvbridge.payload.outputs[0].chunk_sise: unknown key``). The KV part is validated by
the KV manager's own ``KVTransferConfig.from_dict`` (imported lazily, so this module has
no dependency on the KV layer's import time).

``custom_process_next_stage_input_func`` is called as
``func(payload: dict, *, request_id: str, final: bool) -> dict`` on the sender just before
a payload (or chunk) is put; it turns the producer's outputs into the next stage's inputs.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_kvbridge.errors import ConfigError

ADDITIONAL_CONFIG_KEY = "kvbridge"
TRIGGERS = ("on_finish", "prefill_finished", "special_token")
PAYLOAD_MODES = ("full", "async_chunk")
#: How a consumer LLM stage takes an input edge's payload (see runner/conditioning.py):
#: the hidden states as the request's prompt embeddings once the payload is complete, or
#: row by row as the model's per-position conditioning while the stream arrives.
PAYLOAD_FEEDS = ("prompt_embeds", "per_step")
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+(:[A-Za-z_][A-Za-z0-9_.]*)?")
_STAGE = re.compile(r"[A-Za-z0-9_-]{1,32}")


def _check_keys(data: Any, known: set[str], path: str) -> Mapping[str, Any]:
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: expected a mapping, got {type(data).__name__}")
    for key in data:
        if key not in known:
            raise ConfigError(f"{path}.{key}: unknown key (known: {', '.join(sorted(known))})")
    return data


def _typed(
    data: Mapping[str, Any], name: str, kinds: type | tuple[type, ...], default: Any, path: str
) -> Any:
    value = data.get(name, default)
    if value is None and default is None:
        return None
    # bool is an int subclass; a bool where a number is expected is a typo, not a 1.
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise ConfigError(f"{path}.{name}: expected {_kind_names(kinds)}, got {value!r}")
    if not isinstance(value, kinds):
        raise ConfigError(f"{path}.{name}: expected {_kind_names(kinds)}, got {value!r}")
    return value


def _kind_names(kinds: type | tuple[type, ...]) -> str:
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    return " or ".join(k.__name__ for k in kinds)


def _positive(value: float, path: str) -> None:
    if not value > 0:
        raise ConfigError(f"{path}: must be > 0, got {value!r}")


def _stage_id(value: Any, path: str) -> int | str:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigError(f"{path}: expected int or str, got {value!r}")
    if isinstance(value, int) and value < 0:
        raise ConfigError(f"{path}: must be >= 0, got {value}")
    if isinstance(value, str) and not _STAGE.fullmatch(value):
        raise ConfigError(f"{path}: must match [A-Za-z0-9_-]{{1,32}}, got {value!r}")
    return value


def load_dotted(path: str, what: str = "object") -> Any:
    """Import ``pkg.mod.attr`` or ``pkg.mod:attr``; ConfigError (with the cause) if it fails."""
    if not isinstance(path, str) or not _DOTTED.fullmatch(path):
        raise ConfigError(f"{what}: {path!r} is not a dotted path like 'pkg.module.func'")
    if ":" in path:
        module_name, attr = path.split(":", 1)
    else:
        module_name, _, attr = path.rpartition(".")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"{what}: cannot load {path!r}: {exc}") from exc
    return obj


@dataclass(frozen=True)
class KVSendSettings:
    """When the AR runner sends a request's KV cache (see :mod:`vllm_kvbridge.runner.vllm_connector`)."""

    trigger: str = "on_finish"
    trigger_token_id: int | None = None
    stop_after_transfer: bool = False

    @classmethod
    def from_dict(cls, data: Any, path: str = "kvbridge.kv_send") -> KVSendSettings:
        d = _check_keys(data, {"trigger", "trigger_token_id", "stop_after_transfer"}, path)
        trigger = _typed(d, "trigger", str, "on_finish", path)
        if trigger not in TRIGGERS:
            raise ConfigError(f"{path}.trigger: must be one of {', '.join(TRIGGERS)}, got {trigger!r}")
        token = _typed(d, "trigger_token_id", int, None, path)
        stop = _typed(d, "stop_after_transfer", bool, False, path)
        if trigger == "special_token" and token is None:
            raise ConfigError(f"{path}.trigger_token_id: required when trigger is 'special_token'")
        if trigger != "special_token" and token is not None:
            raise ConfigError(f"{path}.trigger_token_id: only valid with trigger 'special_token'")
        if token is not None and token < 0:
            raise ConfigError(f"{path}.trigger_token_id: must be >= 0, got {token}")
        if stop and trigger != "prefill_finished":
            raise ConfigError(f"{path}.stop_after_transfer: only valid with trigger 'prefill_finished'")
        return cls(trigger, token, stop)


@dataclass(frozen=True)
class PayloadEdgeSettings:
    """One payload edge as this stage sees it (``peer_stage`` is the other end)."""

    peer_stage: int | str
    mode: str
    connector: str
    connector_config: dict[str, Any] = field(default_factory=dict)
    chunk_size: int = 16
    recv_timeout_s: float = 30.0
    stall_timeout_s: float = 30.0
    send_retries: int = 3
    send_timeout_s: float = 60.0
    #: input edges only: one of :data:`PAYLOAD_FEEDS`
    feed: str = "prompt_embeds"

    @classmethod
    def from_dict(cls, data: Any, *, direction: str, path: str) -> PayloadEdgeSettings:
        peer_key = "to_stage" if direction == "output" else "from_stage"
        # No TP size: payloads travel on TP rank 0 and are broadcast within a stage.
        common = {peer_key, "mode", "connector", "connector_config"}
        extra = (
            {"chunk_size", "send_retries", "send_timeout_s"}
            if direction == "output"
            else {"recv_timeout_s", "stall_timeout_s", "feed"}
        )
        d = _check_keys(data, common | extra, path)
        if peer_key not in d:
            raise ConfigError(f"{path}.{peer_key}: required")
        peer = _stage_id(d[peer_key], f"{path}.{peer_key}")
        mode = _typed(d, "mode", str, "full", path)
        if mode not in PAYLOAD_MODES:
            raise ConfigError(f"{path}.mode: must be one of {', '.join(PAYLOAD_MODES)}, got {mode!r}")
        connector = _typed(d, "connector", str, "SharedMemoryConnector", path)
        cfg = _typed(d, "connector_config", dict, {}, path)
        chunk = _typed(d, "chunk_size", int, 16, path)
        _positive(chunk, f"{path}.chunk_size")
        recv = float(_typed(d, "recv_timeout_s", (int, float), 30.0, path))
        _positive(recv, f"{path}.recv_timeout_s")
        stall = float(_typed(d, "stall_timeout_s", (int, float), 30.0, path))
        _positive(stall, f"{path}.stall_timeout_s")
        retries = _typed(d, "send_retries", int, 3, path)
        if retries < 0:
            raise ConfigError(f"{path}.send_retries: must be >= 0, got {retries}")
        send_timeout = float(_typed(d, "send_timeout_s", (int, float), 60.0, path))
        _positive(send_timeout, f"{path}.send_timeout_s")
        feed = _typed(d, "feed", str, "prompt_embeds", path)
        if feed not in PAYLOAD_FEEDS:
            raise ConfigError(f"{path}.feed: must be one of {', '.join(PAYLOAD_FEEDS)}, got {feed!r}")
        return cls(peer, mode, connector, dict(cfg), chunk, recv, stall, retries, send_timeout, feed)


@dataclass(frozen=True)
class PayloadSettings:
    """What the runner captures and on which edges payloads travel."""

    capture_hidden_states: bool = False
    capture_token_ids: bool = True
    replace_keys: tuple[str, ...] = ()
    custom_process_next_stage_input_func: str | None = None
    outputs: tuple[PayloadEdgeSettings, ...] = ()
    inputs: tuple[PayloadEdgeSettings, ...] = ()

    @classmethod
    def from_dict(cls, data: Any, path: str = "kvbridge.payload") -> PayloadSettings:
        known = {
            "capture_hidden_states",
            "capture_token_ids",
            "replace_keys",
            "custom_process_next_stage_input_func",
            "outputs",
            "inputs",
        }
        d = _check_keys(data, known, path)
        hidden = _typed(d, "capture_hidden_states", bool, False, path)
        tokens = _typed(d, "capture_token_ids", bool, True, path)
        replace = _typed(d, "replace_keys", (list, tuple), [], path)
        for i, key in enumerate(replace):
            if not isinstance(key, str):
                raise ConfigError(f"{path}.replace_keys[{i}]: expected str, got {key!r}")
        func = _typed(d, "custom_process_next_stage_input_func", str, None, path)
        if func is not None and not _DOTTED.fullmatch(func):
            raise ConfigError(f"{path}.custom_process_next_stage_input_func: {func!r} is not a dotted path")
        edges: dict[str, tuple[PayloadEdgeSettings, ...]] = {}
        for name, direction in (("outputs", "output"), ("inputs", "input")):
            items = _typed(d, name, (list, tuple), [], path)
            edges[name] = tuple(
                PayloadEdgeSettings.from_dict(item, direction=direction, path=f"{path}.{name}[{i}]")
                for i, item in enumerate(items)
            )
            peers = [e.peer_stage for e in edges[name]]
            if len(set(peers)) != len(peers):
                raise ConfigError(f"{path}.{name}: one edge per peer stage, got {peers}")
        return cls(hidden, tokens, tuple(replace), func, edges["outputs"], edges["inputs"])

    @property
    def sends(self) -> bool:
        return bool(self.outputs)

    @property
    def captures(self) -> bool:
        """The AR runner captures (hidden states or token ids) for payloads it sends."""
        return self.sends and (self.capture_hidden_states or self.capture_token_ids)

    @property
    def per_step_inputs(self) -> tuple[PayloadEdgeSettings, ...]:
        """Input edges whose rows condition the model per position (runner/conditioning.py)."""
        return tuple(e for e in self.inputs if e.feed == "per_step")

    def process_func(self) -> Callable[..., dict[str, Any]] | None:
        """The loaded ``custom_process_next_stage_input_func`` (None when unset)."""
        if self.custom_process_next_stage_input_func is None:
            return None
        func = load_dotted(
            self.custom_process_next_stage_input_func, "kvbridge.payload.custom_process_next_stage_input_func"
        )
        if not callable(func):
            raise ConfigError(
                "kvbridge.payload.custom_process_next_stage_input_func: "
                f"{self.custom_process_next_stage_input_func!r} is not callable"
            )
        return func


@dataclass(frozen=True)
class RunnerSettings:
    """Everything a kvbridge runner needs; see the module docstring for the dict form."""

    stage_id: int | str = 0
    kv_transfer: dict[str, Any] | None = None
    kv_send: KVSendSettings = field(default_factory=KVSendSettings)
    payload: PayloadSettings = field(default_factory=PayloadSettings)
    #: A subclass of the AR runner for the runner class in use ("pkg.mod.Class"), which the
    #: kvbridge worker builds instead of its own (see runner/ar_runner.py, "Subclassing").
    runner_cls: str | None = None

    @classmethod
    def from_dict(cls, data: Any, path: str = ADDITIONAL_CONFIG_KEY) -> RunnerSettings:
        d = _check_keys(data, {"stage_id", "kv_transfer", "kv_send", "payload", "runner_cls"}, path)
        runner_cls = d.get("runner_cls")
        if runner_cls is not None and (not isinstance(runner_cls, str) or not _DOTTED.fullmatch(runner_cls)):
            raise ConfigError(f"{path}.runner_cls: {runner_cls!r} is not a dotted path like 'pkg.mod.Class'")
        stage_id = _stage_id(d.get("stage_id", 0), f"{path}.stage_id")
        kv = d.get("kv_transfer")
        if kv is not None:
            if not isinstance(kv, Mapping):
                raise ConfigError(f"{path}.kv_transfer: expected a mapping, got {type(kv).__name__}")
            kv = dict(kv)
            # Validate now (the KV layer's own schema) so a typo fails at start-up, not at
            # the first finished request.
            from vllm_kvbridge.kv.config import KVTransferConfig

            KVTransferConfig.from_dict(kv, path=f"{path}.kv_transfer")
        return cls(
            stage_id=stage_id,
            kv_transfer=kv,
            kv_send=KVSendSettings.from_dict(d.get("kv_send"), f"{path}.kv_send"),
            payload=PayloadSettings.from_dict(d.get("payload"), f"{path}.payload"),
            runner_cls=runner_cls,
        )

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> RunnerSettings:
        """Read ``kv_transfer_config.kv_connector_extra_config["kvbridge"]`` or
        ``additional_config["kvbridge"]`` (empty settings when both are absent)."""
        from vllm_kvbridge.kv.config import vllm_settings

        data, path = vllm_settings(vllm_config)
        return cls.from_dict(data, path=path)

    def kv_transfer_config(self) -> Any:
        """The KV manager's ``KVTransferConfig`` (None when the stage moves no KV)."""
        if self.kv_transfer is None:
            return None
        from vllm_kvbridge.kv.config import KVTransferConfig

        cfg = dict(self.kv_transfer)
        cfg.setdefault("stage_id", self.stage_id)
        return KVTransferConfig.from_dict(cfg, path=f"{ADDITIONAL_CONFIG_KEY}.kv_transfer")

    @property
    def sends_kv(self) -> bool:
        return bool(self.kv_transfer and self.kv_transfer.get("need_send_cache"))

    @property
    def receives_kv(self) -> bool:
        return bool(self.kv_transfer and self.kv_transfer.get("need_recv_cache"))

    @property
    def needs_connector(self) -> bool:
        """True when this stage moves anything (KV or payloads)."""
        return self.sends_kv or self.receives_kv or bool(self.payload.outputs or self.payload.inputs)

    @property
    def needs_runner(self) -> bool:
        """True when this stage moves payloads or names a ``runner_cls``: its model runner must
        have the kvbridge mixin. KV alone needs none (the KV connector gathers it; see
        runner/kv_sender.py)."""
        return bool(self.payload.outputs or self.payload.inputs or self.runner_cls)
