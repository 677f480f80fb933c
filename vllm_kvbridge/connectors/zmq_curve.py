"""CURVE keys of :class:`~vllm_kvbridge.connectors.zmq_p2p.ZmqConnector` (see its docstring).

:class:`CurveKeys` reads and checks the connector's CURVE options once (``curve_keys_env``
included) and applies them: to the server's ROUTER socket with a ZAP handler admitting
exactly ``curve_allowed_clients``, and to a client's DEALER socket pinning the server key.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import zmq

from vllm_kvbridge.errors import ConfigError


def z85_key(config: Mapping[str, Any], name: str) -> bytes | None:
    """The 40-character z85 CURVE key ``config[name]`` as bytes (None when absent)."""
    value = config.get(name)
    if value is None:
        return None
    raw = value.encode("ascii") if isinstance(value, str) else bytes(value)
    if len(raw) != 40:
        raise ConfigError(f"connector option {name!r} must be a 40-character z85 CURVE key")
    return raw


def _with_env_keys(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """``curve_keys_env``: the edge's shared CURVE keypair, from the environment."""
    name = config.get("curve_keys_env")
    if not name:
        return config
    given = [k for k in ("curve_public_key", "curve_secret_key", "curve_allowed_clients") if k in config]
    if given:
        raise ConfigError(f"connector option curve_keys_env excludes {given}: give one or the other")
    raw = os.environ.get(str(name))
    if not raw:
        raise ConfigError(f"connector option curve_keys_env: ${name} is not set")
    try:
        keys = json.loads(raw)
        public, secret = str(keys["public"]), str(keys["secret"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f'connector option curve_keys_env: ${name} must hold {{"public", "secret"}}: {exc}'
        ) from None
    return {
        **config,
        "curve_public_key": public,
        "curve_secret_key": secret,
        "curve_allowed_clients": [public],
        "curve_server_key": public,
    }


class _AllowList:
    """ZAP credentials provider: admits exactly the configured client public keys."""

    def __init__(self, keys: set[bytes]) -> None:
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


@dataclass(frozen=True)
class CurveKeys:
    """This connector's keypair, the server key it pins and the clients it admits."""

    public: bytes | None = None
    secret: bytes | None = None
    server_key: bytes | None = None
    allowed: frozenset[bytes] | None = None

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> CurveKeys:
        cfg = _with_env_keys(config)
        public, secret = z85_key(cfg, "curve_public_key"), z85_key(cfg, "curve_secret_key")
        if (public is None) != (secret is None):
            raise ConfigError("CURVE needs both curve_public_key and curve_secret_key")
        given = cfg.get("curve_allowed_clients")
        allowed = (
            None
            if given is None
            else frozenset(k.encode("ascii") if isinstance(k, str) else bytes(k) for k in given)
        )
        if allowed is not None and public is None:
            raise ConfigError("curve_allowed_clients needs the server keypair (curve_public_key/secret_key)")
        if public is not None and allowed is None:
            raise ConfigError("a CURVE server needs curve_allowed_clients (the client public keys it admits)")
        return cls(public, secret, z85_key(cfg, "curve_server_key"), allowed)

    @property
    def enabled(self) -> bool:
        return self.public is not None

    def server_key_for(self, metadata: Mapping[str, Any] | None) -> bytes | None:
        """The server key a client pins: configured, else the put metadata's (None: no CURVE)."""
        if self.server_key is not None or not self.enabled:
            return self.server_key
        return z85_key(metadata or {}, "server_key")

    def secure_server(self, ctx: zmq.Context, router: zmq.Socket) -> Any:
        """Make ``router`` a CURVE server admitting ``allowed``; the started authenticator."""
        from zmq.auth.thread import ThreadAuthenticator

        auth = ThreadAuthenticator(ctx)
        auth.start()
        auth.configure_curve_callback(domain="*", credentials_provider=_AllowList(set(self.allowed or ())))
        router.curve_server = True
        router.curve_publickey = self.public
        router.curve_secretkey = self.secret
        return auth

    def secure_client(self, sock: zmq.Socket, server_key: bytes) -> None:
        sock.curve_serverkey = server_key
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret
