"""Imports only point down the layers (docs/architecture.md, section 2), read from the code.

cli > bench > server > pipeline > runner > models > kv > connectors > wire > config > procfs > errors.
Every ``import`` of the package is checked, including the lazy ones inside functions.
"""

from __future__ import annotations

import ast
from pathlib import Path

import vllm_kvbridge

PKG = Path(vllm_kvbridge.__file__).parent
ORDER = [
    "errors",
    "procfs",
    "config",
    "wire",
    "connectors",
    "kv",
    "models",
    "runner",
    "pipeline",
    "server",
    "bench",
    "cli",
]
RANK = {name: i for i, name in enumerate(ORDER)}
#: Known upward arrows, each with why it is still there (remove the entry with the fix).
KNOWN_UP = {
    # The resolver checks connector names against the registry (lazy import).
    ("vllm_kvbridge/config/resolve.py", "vllm_kvbridge.connectors.registry"),
    # The DiT's KV geometry is read from its sender's config.json; a `kvbridge://` sender
    # is built first (lazy import; its stage would build it anyway).
    ("vllm_kvbridge/config/kv_geometry.py", "vllm_kvbridge.models.builtin"),
}
#: Connector internals nothing above the connector layer may import.
PRIVATE = ("vllm_kvbridge.connectors.shm_segments",)


def _imports() -> list[tuple[str, str, int]]:
    out = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            out += [(rel, n, node.lineno) for n in names if n.startswith("vllm_kvbridge.")]
    return out


def _layer(module_path: str) -> str:
    return module_path.split("/")[1].removesuffix(".py") if "/" in module_path else module_path.split(".")[1]


def test_imports_point_down() -> None:
    up = []
    for rel, target, line in _imports():
        src, dst = _layer(rel), target.split(".")[1]
        if src == dst or src == "__init__" or (rel, target) in KNOWN_UP:
            continue
        assert src in RANK and dst in RANK, f"{rel}: a layer the test does not know ({src} or {dst})"
        if RANK[dst] > RANK[src]:
            up.append(f"{rel}:{line} ({src}) imports {target} ({dst})")
    assert up == []


def test_connector_internals_stay_in_the_connector_layer() -> None:
    reach = [
        f"{rel}:{line} imports {target}"
        for rel, target, line in _imports()
        if target.startswith(PRIVATE) and _layer(rel) != "connectors"
    ]
    assert reach == []


#: The kvbridge layers on vLLM's runner (issue 38): thin, each over one composed object.
_MIXIN_LAYERS = ("runner/runtime.py", "runner/payload_transport.py", "runner/mixin.py")


def test_the_runner_mixin_layers_meet_through_objects_not_super_chains() -> None:
    """No ``super()`` in the three mixin layers: each delegates to its object, and the
    objects meet through the Protocols declared where they are used."""
    for rel in _MIXIN_LAYERS:
        tree = ast.parse((PKG / rel).read_text(), rel)
        calls = [
            n.lineno
            for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "super"
        ]
        assert calls == [], f"{rel}: super() at lines {calls}"


def test_vllms_runner_carries_at_most_25_kvbridge_names() -> None:
    from vllm_kvbridge.runner.ar_runner import KVBridgeARModelRunner

    names = {
        name
        for cls in KVBridgeARModelRunner.__mro__
        if cls.__module__.startswith("vllm_kvbridge.")
        for name, value in vars(cls).items()
        if not (name.startswith("__") and name.endswith("__"))
        and (callable(value) or isinstance(value, (property, staticmethod, classmethod)))
    }
    assert len(names) <= 25, sorted(names)


def test_the_connector_never_calls_the_runner() -> None:
    """vLLM's split: the runner calls the connector (``take_step_events``), never the reverse."""
    for rel in ("runner/vllm_connector.py", "runner/connector_worker.py", "runner/connector_scheduler.py"):
        text = (PKG / rel).read_text()
        # No hook into a runner (the old host attachment) and no runner call.
        assert "_host" not in text and "kvbridge_connector_step(" not in text, rel


def test_no_module_over_600_lines() -> None:
    sizes = {p.relative_to(PKG).as_posix(): len(p.read_text().splitlines()) for p in PKG.rglob("*.py")}
    assert {name: n for name, n in sizes.items() if n > 600} == {}
