"""``KVTransferConfig``: what one stage does with KV caches.

It comes from a stage config (``kv_transfer:`` section) or from the kvbridge settings in
vLLM's config (:func:`vllm_settings`; see
:meth:`vllm_kvbridge.kv.manager.KVTransferManager.from_vllm_config`). Unknown keys
are rejected with their name; types are checked by msgspec.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from vllm_kvbridge.errors import ConfigError

__all__ = ["KVTransferConfig", "vllm_settings"]

#: The key of kvbridge's settings in vLLM's ``kv_connector_extra_config`` / ``additional_config``.
SETTINGS_KEY = "kvbridge"

StageId = int | str


class KVTransferConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """KV transfer settings of one stage (one TP group).

    Sending side: ``need_send_cache``, ``to_stage`` (the stage that receives),
    ``send_retries`` extra attempts after the first, spaced by an exponential backoff
    ``send_backoff_s * 2**i`` capped at ``send_max_backoff_s``; ``from_tp``/``to_tp`` are the
    TP sizes of the sending and the receiving stage of the edge. Backpressure: a put into a
    full edge (the sender holds its connector's limit of unread bytes) is put again until
    there is room, for up to ``send_timeout`` seconds, then its request fails; while the
    gathered KV waiting for its puts exceeds ``max_send_queue_bytes``, the KV of finished
    requests stays in the engine's blocks (not gathered yet), so the engine admits no more
    than its cache holds instead of growing memory. ``staging_bytes``: the pool of host
    staging buffers (pinned on GPU) the gathered KV waits in until its puts (kv/send.py's
    staged path); 0 gathers straight into the connector's memory on the model thread;
    None (default): for CUDA caches 1/8 of host memory, at most 8 GiB, shared by the
    ``from_tp`` ranks; 0 for CPU caches.

    Receiving side: ``need_recv_cache``, ``from_stage`` (the stage that sends; defaults
    to the first of ``engine_input_source``), ``recv_timeout`` seconds per receive
    (monotonic deadline), async prefetch (``enable_kv_async_prefetch``,
    ``max_prefetch_inflight`` receives at once, none started while less than
    ``kv_prefetch_min_free_mem_ratio`` of the target device's memory is free), and
    ``max_unconsumed`` KVs received (or prefetched) but not yet taken by their request are
    kept at most, the oldest dropped beyond that (a request that later asks for a dropped
    KV fails: it was aborted downstream or never asked for in time), and
    ``distribution``: ``"local"`` (every TP rank receives its own heads) or ``"leader"``
    (group rank 0 receives the full KV and broadcasts it to the other ranks of the stage's
    process group, e.g. a diffusion stage whose ranks all need all heads).

    ``expect_kv`` (receiver): what the received KV must be (``model``, ``dtype``,
    ``num_layers``, ``num_kv_heads``, ``head_dim``; any subset), checked against the sender's
    declaration before the KV is used (:mod:`vllm_kvbridge.kv.compat`).

    ``connector`` is a registry name (see :mod:`vllm_kvbridge.connectors.registry`),
    ``connector_config`` its config dict.
    """

    need_send_cache: bool = False
    need_recv_cache: bool = False
    stage_id: StageId = 0
    from_stage: StageId | None = None
    to_stage: StageId | None = None
    engine_input_source: list[StageId] = msgspec.field(default_factory=list)
    recv_timeout: float = 60.0
    send_retries: int = 3
    send_backoff_s: float = 0.05
    send_max_backoff_s: float = 2.0
    send_timeout: float = 60.0
    max_send_queue_bytes: int = 1 << 30
    staging_bytes: int | None = None
    from_tp: int = 1
    to_tp: int = 1
    tp_rank: int | None = None
    num_kv_heads: int | None = None
    enable_kv_async_prefetch: bool = False
    kv_prefetch_min_free_mem_ratio: float = 0.1
    max_prefetch_inflight: int = 4
    max_unconsumed: int = 256
    distribution: Literal["local", "leader"] = "local"
    expect_kv: dict[str, Any] | None = None
    connector: str = "SharedMemoryConnector"
    connector_config: dict[str, Any] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ConfigError:
            return ConfigError(f"kv_transfer.{name}: {why}, got {getattr(self, name)!r}")

        if not self.recv_timeout > 0:
            raise bad("recv_timeout", "must be > 0")
        if self.send_retries < 0:
            raise bad("send_retries", "must be >= 0")
        if self.send_backoff_s < 0:
            raise bad("send_backoff_s", "must be >= 0")
        if not self.send_timeout > 0:
            raise bad("send_timeout", "must be > 0")
        if self.max_send_queue_bytes < 1:
            raise bad("max_send_queue_bytes", "must be >= 1")
        if self.staging_bytes is not None and self.staging_bytes < 0:
            raise bad("staging_bytes", "must be >= 0")
        if self.send_max_backoff_s < self.send_backoff_s:
            raise bad("send_max_backoff_s", "must be >= send_backoff_s")
        for name in ("from_tp", "to_tp", "max_prefetch_inflight", "max_unconsumed"):
            if getattr(self, name) < 1:
                raise bad(name, "must be >= 1")
        if self.num_kv_heads is not None and self.num_kv_heads < 1:
            raise bad("num_kv_heads", "must be >= 1")
        if self.tp_rank is not None and self.tp_rank < 0:
            raise bad("tp_rank", "must be >= 0")
        if not 0.0 <= self.kv_prefetch_min_free_mem_ratio < 1.0:
            raise bad("kv_prefetch_min_free_mem_ratio", "must be in [0, 1)")
        if self.need_send_cache and self.to_stage is None:
            raise ConfigError("kv_transfer.to_stage: required when need_send_cache is true")
        from vllm_kvbridge.kv.compat import check_expectation

        try:
            self.expect_kv = check_expectation(self.expect_kv, "kv_transfer.expect_kv")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.need_recv_cache and self.from_stage is None and not self.engine_input_source:
            raise ConfigError(
                "kv_transfer.from_stage: required when need_recv_cache is true (or set engine_input_source)"
            )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, *, path: str = "kv_transfer") -> KVTransferConfig:
        """Build from a plain dict; unknown keys and wrong types raise ConfigError naming the key."""
        if data is None:
            return cls()
        if not isinstance(data, Mapping):
            raise ConfigError(f"{path}: expected a mapping, got {type(data).__name__}")
        known = set(cls.__struct_fields__)
        for key in data:
            if key not in known:
                raise ConfigError(f"{path}.{key}: unknown key (known: {', '.join(sorted(known))})")
        try:
            return msgspec.convert(dict(data), cls, strict=False)
        except msgspec.ValidationError as exc:
            # msgspec says e.g. "Expected `int`, got `str` - at `$.from_tp`"
            raise ConfigError(f"{path}: {str(exc).replace('$.', path + '.')}") from None

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    @property
    def send_stages(self) -> list[StageId]:
        """Stages this stage sends KV to."""
        return [self.to_stage] if self.need_send_cache and self.to_stage is not None else []

    @property
    def recv_stages(self) -> list[StageId]:
        """Stages this stage receives KV from (``from_stage``, else ``engine_input_source``)."""
        if not self.need_recv_cache:
            return []
        if self.from_stage is not None:
            return [self.from_stage]
        return list(self.engine_input_source)

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before retry number ``attempt`` (0-based)."""
        return min(self.send_backoff_s * (2**attempt), self.send_max_backoff_s)


def vllm_settings(vllm_config: Any) -> tuple[Mapping[str, Any] | None, str]:
    """The kvbridge settings dict in a vLLM config and where it was found (for errors).

    ``kv_transfer_config.kv_connector_extra_config["kvbridge"]`` (the one argument a stock
    ``vllm serve --kv-transfer-config`` needs), else ``additional_config["kvbridge"]``;
    ``(None, ...)`` when neither is set. Both set and different is an error.
    """
    kv_transfer = getattr(vllm_config, "kv_transfer_config", None)
    extra = getattr(kv_transfer, "kv_connector_extra_config", None) or {}
    additional = getattr(vllm_config, "additional_config", None) or {}
    from_extra = extra.get(SETTINGS_KEY) if isinstance(extra, Mapping) else None
    from_additional = additional.get(SETTINGS_KEY) if isinstance(additional, Mapping) else None
    if from_extra is not None and from_additional is not None and from_extra != from_additional:
        raise ConfigError(
            "kvbridge settings are given twice and differ: kv_transfer_config."
            "kv_connector_extra_config['kvbridge'] and additional_config['kvbridge']; give one"
        )
    if from_extra is not None:
        return from_extra, f"kv_connector_extra_config.{SETTINGS_KEY}"
    return from_additional, f"additional_config.{SETTINGS_KEY}"
