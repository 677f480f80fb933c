"""Classifier-free guidance in the diffusion stage: real SharedMemoryConnector, real KV
managers, real gloo ranks; no vLLM engine (the end-to-end runs are test_pipeline_cfg*.py).

The primary KV and its ``cfg_neg`` companion are sent by a sender-side manager from fake
paged caches in vLLM's CPU layout; the runner must receive both through its one hook and
paint exactly the image a guided denoise of the reference KVs paints, on 1 and on 2 ranks.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from kv_fixtures import HEAD, NUM_LAYERS, fake_cpu_caches, reference_kv, request_plan
from runner_fixtures import cfg_stage, dit_rank_worker, send_cfg_kv

from vllm_kvbridge.errors import ConfigError, TransferTimeout
from vllm_kvbridge.models.guidance import CFG_NEGATIVE, cfg_combine
from vllm_kvbridge.models.tiny_dit import TinyKVDiT
from vllm_kvbridge.pipeline.cfg import CompanionGroups, companion_request_id
from vllm_kvbridge.runner.diffusion_runner import DiffusionRequest, DiffusionRunner, denoise


def _kv(seed: int, seq: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(seq, 2, 32, generator=g), torch.randn(seq, 2, 32, generator=g)) for _ in range(2)]


def _leftovers(namespace: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if f".{namespace}." in n]


def _plans() -> dict[str, dict]:
    """Primary ``a-1`` and its companion, which the LLM stage runs as ``a-1::cfg_neg``."""
    cid = companion_request_id("a-1", CFG_NEGATIVE)
    return {
        "a-1": request_plan(1),
        cid: {**request_plan(3), "purpose": CFG_NEGATIVE, "companion_of": "a-1"},
        "b-2": request_plan(2),  # unguided
    }


def _ref(caches: list[torch.Tensor], plan: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    keys, values = reference_kv(caches, plan)
    return list(zip(keys, values))


def test_tiny_dit_guidance_mixes_two_branches() -> None:
    model = TinyKVDiT(image_size=16, seed=0).eval()
    x, t = torch.randn(1, *model.latent_shape), torch.ones(1)
    cond, uncond = _kv(1, 5), _kv(2, 3)  # the two prompts differ in length
    with torch.no_grad():
        vc, vu = model(x, t, cond), model(x, t, uncond)
        assert torch.equal(model.guided_forward(x, t, cond, uncond, 4.0), vu + 4.0 * (vc - vu))
        assert torch.equal(model.guided_forward(x, t, cond, uncond, 1.0), cfg_combine(vc, vu, 1.0))
    guided = denoise(model, cond, num_steps=4, seed=0, uncond_kv=uncond, guidance_scale=4.0)
    plain = denoise(model, cond, num_steps=4, seed=0)
    other_neg = denoise(model, cond, num_steps=4, seed=0, uncond_kv=_kv(3, 3), guidance_scale=4.0)
    assert torch.isfinite(guided).all() and guided.min() >= 0 and guided.max() <= 1
    assert not torch.allclose(guided, plain)  # guidance changes the image ...
    assert not torch.allclose(guided, other_neg)  # ... and depends on the companion's KV


@pytest.mark.forked
def test_primary_and_companion_received_through_one_hook_image_exact() -> None:
    ns = f"ditcfg{os.getpid()}"
    caches = fake_cpu_caches(2, seed=5)
    plans = _plans()
    cid = companion_request_id("a-1", CFG_NEGATIVE)
    sender = send_cfg_kv(ns, caches, plans)
    try:
        # the companion's sender info is filed under its own id, the primary's under its id
        info_a, info_c = sender.get_sender_info("a-1"), sender.get_sender_info(cid)
        assert info_a and info_c and set(info_a["keys"]).isdisjoint(info_c["keys"])
        assert all(".cfg_neg.ia-1." in k for k in info_c["keys"])
        runner = DiffusionRunner(cfg_stage(ns))
        try:
            merged = {"keys": {**info_a["keys"], **info_c["keys"]}, "num_kv_heads": 2}
            guided = DiffusionRequest("a-1", "a-1", 0, merged, cfg_purposes=[CFG_NEGATIVE])
            plain = DiffusionRequest("b-2", "b-2", 0, sender.get_sender_info("b-2"), guidance_scale=1.0)
            runner.prefetch(guided)  # the prefetch takes the companion too (same hook)
            out_g, out_p = runner.execute(guided), runner.execute(plain)
            with pytest.raises(ConfigError, match="needs the 'cfg_neg' companion"):
                runner.execute(DiffusionRequest("c-3", "c-3", 0, {}))  # guided by default, no companion
        finally:
            runner.close()
    finally:
        sender.shutdown()
    module = TinyKVDiT(image_size=16, seed=0).eval()
    want_g = denoise(
        module,
        _ref(caches, plans["a-1"]),
        num_steps=3,
        seed=0,
        uncond_kv=_ref(caches, plans[cid]),
        guidance_scale=3.0,
    )[0]
    assert torch.equal(out_g.image, want_g)
    assert torch.equal(out_p.image, denoise(module, _ref(caches, plans["b-2"]), num_steps=3, seed=0)[0])
    per_token = NUM_LAYERS * 2 * 2 * HEAD * 4  # layers x (K, V) x heads x dim x fp32
    assert out_g.kv_transfers == {
        "kv": plans["a-1"]["seq_len"] * per_token,
        CFG_NEGATIVE: plans[cid]["seq_len"] * per_token,
    }
    assert out_p.kv_transfers == {"kv": plans["b-2"]["seq_len"] * per_token}
    assert _leftovers(ns) == []


@pytest.mark.forked
def test_missing_companion_fails_within_one_deadline_naming_it() -> None:
    ns = f"ditcfgmiss{os.getpid()}"
    caches = fake_cpu_caches(2, seed=5)
    plans = {"a-1": request_plan(1)}  # the companion was never sent
    sender = send_cfg_kv(ns, caches, plans)
    runner = DiffusionRunner(cfg_stage(ns, recv_timeout=1.0))
    try:
        info = sender.get_sender_info("a-1")
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout, match=r"CFG companion 'cfg_neg' of a-1") as err:
            runner.execute(DiffusionRequest("a-1", "a-1", 0, info, cfg_purposes=[CFG_NEGATIVE]))
        elapsed = time.monotonic() - t0
        assert 0.9 < elapsed < 1.9, elapsed  # one deadline for the group, not one per cache
        assert "1.0" in str(err.value)
        # neither missing: the primary's deadline is the group's (nothing waits longer)
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout, match="'kv' of never"):
            runner.execute(DiffusionRequest("never", "never", 0, {}, cfg_purposes=[CFG_NEGATIVE]))
        assert time.monotonic() - t0 < 1.9
    finally:
        runner.close()
        sender.shutdown()
    assert _leftovers(ns) == []


def test_companion_groups_report_once_and_fail_the_whole_group() -> None:
    groups = CompanionGroups()
    ids = groups.add("r", {CFG_NEGATIVE: "blurry"})
    cid = companion_request_id("r", CFG_NEGATIVE)
    assert ids == {cid: "blurry"} and groups.owner(cid) == ("r", CFG_NEGATIVE) and groups.owner("r") is None
    groups.primary_done("r", "done-r")
    assert groups.complete("r") is None  # the companion is still being sent
    groups.companion_done(cid, {"keys": {"k": 1}})
    assert groups.complete("r") == ("done-r", [{"keys": {"k": 1}}])
    assert groups.complete("r") is None and groups.owner(cid) is None  # reported once
    # an Abort that crossed the report: the companion's KV is out, it is named once
    assert groups.fail("r") == [cid] and groups.fail("r") == []
    groups.add("s", {CFG_NEGATIVE: ""})
    assert groups.fail(companion_request_id("s", CFG_NEGATIVE)) == [
        "s",
        companion_request_id("s", CFG_NEGATIVE),
    ]
    assert groups.fail("s") == [] and not groups.has("s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
@pytest.mark.forked
@pytest.mark.long(180, "a 2-rank DiT stage: two processes joining a gloo group, plus the one-rank reference")
@pytest.mark.parametrize("sender_tp", [1, 2])
def test_two_ranks_cfg_parallel_equal_one_rank_and_follower_never_touches_connector(
    sender_tp: int, tmp_path: Path
) -> None:
    """Rank 0 receives (from a TP-1 sender, or merging the heads of a TP-2 sender), rank 1
    gets the KV through distribute_kv_cache; the images equal the 1-rank run bit for bit."""
    ns = f"dit2r{sender_tp}{os.getpid()}"
    out = tmp_path
    heads = 2 // sender_tp
    caches = [fake_cpu_caches(heads, seed=5 + r) for r in range(sender_tp)]
    plans = _plans()
    cid = companion_request_id("a-1", CFG_NEGATIVE)
    senders = [send_cfg_kv(ns, caches[r], plans, tp_rank=r, from_tp=sender_tp) for r in range(sender_tp)]

    def info(rid: str) -> dict:
        keys = {k: v for s in senders for k, v in s.get_sender_info(rid)["keys"].items()}
        return {"keys": keys, "num_kv_heads": 2}

    def ref(plan: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
        parts = [_ref(c, plan) for c in caches]  # each rank's heads, merged in head order
        return [
            (torch.cat([p[i][0] for p in parts], 1), torch.cat([p[i][1] for p in parts], 1)) for i in range(3)
        ]

    try:
        merged = {"keys": {**info("a-1")["keys"], **info(cid)["keys"]}, "num_kv_heads": 2}
        jobs = [
            {"id": "a-1", "sender_info": merged, "scale": 3.0, "purposes": [CFG_NEGATIVE]},
            {"id": "missing", "sender_info": {}, "scale": 3.0, "purposes": [CFG_NEGATIVE]},  # leader fails
            {"id": "b-2", "sender_info": info("b-2"), "scale": 1.0, "purposes": []},
        ]
        mp.start_processes(
            dit_rank_worker,
            args=(_free_port(), ns, jobs, str(out), sender_tp),
            nprocs=2,
            join=True,
            start_method="spawn",
        )
    finally:
        for s in senders:
            s.shutdown()
    leader = json.loads((out / "rank0.json").read_text())
    follower = json.loads((out / "rank1.json").read_text())
    assert "exception" not in leader and "exception" not in follower, (leader, follower)
    assert leader["a-1"]["ok"] and leader["b-2"]["ok"], leader
    assert not leader["missing"]["ok"] and "did not arrive" in leader["missing"]["error"]
    assert follower["served"] == 2  # both delivered requests reached rank 1, the failed one did not
    # rank 1 never touched the connector: its connector raises on use, and it mapped no segment,
    # while rank 0 (which received) did
    assert leader["shm_maps"] and follower["shm_maps"] == []
    from safetensors.torch import load_file

    torch.set_num_threads(1)  # as the ranks ran: same ops, same threads -> bit-exact
    module = TinyKVDiT(image_size=16, seed=0).eval()
    one_rank = denoise(
        module, ref(plans["a-1"]), num_steps=3, seed=0, uncond_kv=ref(plans[cid]), guidance_scale=3.0
    )[0]
    assert torch.equal(load_file(str(out / "a-1.safetensors"))["image"], one_rank)
    plain = denoise(module, ref(plans["b-2"]), num_steps=3, seed=0)[0]
    assert torch.equal(load_file(str(out / "b-2.safetensors"))["image"], plain)
    assert _leftovers(ns) == []


def _models_server() -> ThreadingHTTPServer:
    """An HTTP server on loopback that answers ``GET /v1/models`` as vLLM's does (the
    external stage's engine waits for its server before it is ready)."""

    class Models(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]}).encode()
            self.send_response(200 if self.path == "/v1/models" else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Models)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_external_llm_stage_fails_a_guided_request_at_once() -> None:
    """An external ``vllm serve`` stage cannot run companions: the request fails at submit,
    naming them, instead of the DiT waiting its deadline for a KV that never comes."""
    from vllm_kvbridge.config import resolve_spec, spec_from_dict
    from vllm_kvbridge.pipeline import messages as m
    from vllm_kvbridge.pipeline.http_engine import HTTPStageEngine

    server = _models_server()
    cfg = {
        "stages": [
            {
                "stage_id": 0,
                "kind": "llm_ar",
                "model": "m",
                "url": f"http://127.0.0.1:{server.server_address[1]}",
                "kv_transfer": {"need_send_cache": True},
            },
            {
                "stage_id": 1,
                "kind": "diffusion",
                "kv_transfer": {"need_recv_cache": True},
                # "m" is the server's model name, not a readable model: geometry given here
                "diffusion": {"kwargs": {"kv_heads": 2, "kv_head_dim": 32}},
            },
        ],
        "connectors": {"zmq": {"name": "zmq"}},
        "edges": [{"from_stage": 0, "to_stage": 1, "connector": "zmq"}],
    }
    engine = HTTPStageEngine(resolve_spec(spec_from_dict(cfg)).stage(0))
    try:
        engine.submit(m.Submit("r-1", prompt="a cat", companions={CFG_NEGATIVE: ""}))
        assert engine.busy()
        [out] = engine.step()
        assert isinstance(out, m.RequestFailed) and out.request_id == "r-1"
        assert "CFG companions ['cfg_neg']" in out.error
    finally:
        engine.close()
        server.shutdown()
        server.server_close()


@pytest.mark.slow
@pytest.mark.forked
@pytest.mark.long(180, "a 2-rank DiT stage: two processes joining a gloo group")
def test_rank1_dying_fails_the_stage_and_leaves_nothing_behind() -> None:
    """The stage engine with its real rank-1 process: rank 1 dies in its first forward; the
    request fails, the stage reports rank 1's exit status, close leaves no process/segment."""
    from pipeline_fixtures import TESTS_DIR

    from vllm_kvbridge.pipeline import messages as m
    from vllm_kvbridge.pipeline.engines import DiffusionStageEngine

    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")]))
    ns = f"dit2rdie{os.getpid()}"
    caches = fake_cpu_caches(2, seed=5)
    plans = _plans()
    cid = companion_request_id("a-1", CFG_NEGATIVE)
    sender = send_cfg_kv(ns, caches, plans)
    stage = cfg_stage(ns, num_ranks=2, recv_timeout=5.0, class_path="pipeline_fixtures.DieOnRank1")
    engine = DiffusionStageEngine(stage)
    rank1 = engine.info()["rank_pids"][1]
    try:
        info = {"keys": {**sender.get_sender_info("a-1")["keys"], **sender.get_sender_info(cid)["keys"]}}
        engine.submit(m.Submit("a-1", upstream=[m.Upstream(0, "a-1", info)], companions={CFG_NEGATIVE: ""}))
        got: list = []
        deadline = time.monotonic() + 120
        with pytest.raises(RuntimeError, match="rank 1 of this diffusion stage exited with status 17"):
            while time.monotonic() < deadline:
                got += engine.step()
                time.sleep(0.05)
        assert all(isinstance(x, m.RequestFailed) for x in got), got  # never a StageDone
    finally:
        engine.close()
        sender.shutdown()
    with pytest.raises(ProcessLookupError):
        os.kill(rank1, 0)
    assert _leftovers(ns) == []


def test_guidance_settings_are_validated_and_decided_per_request() -> None:
    from vllm_kvbridge.config import resolve_spec, spec_from_dict
    from vllm_kvbridge.pipeline.cfg import check_request_id, companions_for

    def plan(**diffusion: object) -> object:
        cfg = {
            "stages": [
                {"stage_id": 0, "kind": "llm_ar", "model": "m", "kv_transfer": {"need_send_cache": True}},
                {
                    "stage_id": 1,
                    "kind": "diffusion",
                    "kv_transfer": {"need_recv_cache": True},
                    # model "m" is a placeholder: the DiT's KV geometry is given here
                    "diffusion": {"kwargs": {"kv_heads": 2, "kv_head_dim": 32}, **diffusion},
                },
            ],
            "connectors": {"shm": {"name": "shm"}},
            "edges": [{"from_stage": 0, "to_stage": 1, "connector": "shm"}],
        }
        return resolve_spec(spec_from_dict(cfg))

    with pytest.raises(ConfigError, match=r"stages\[1\]\.diffusion\.num_ranks: 1 or 2"):
        plan(num_ranks=3)
    with pytest.raises(ConfigError, match=r"stages\[1\]\.diffusion\.guidance_scale: must be >= 0"):
        plan(guidance_scale=-1.0)
    off, on = plan(), plan(guidance_scale=4.0, negative_prompt="blurry")
    assert companions_for(off, None) == {}
    assert companions_for(on, None) == {CFG_NEGATIVE: "blurry"}
    assert companions_for(on, {1: {"guidance_scale": 1.0}}) == {}  # switched off per request
    assert companions_for(off, {1: {"guidance_scale": 2.0, "negative_prompt": "dark"}}) == {
        CFG_NEGATIVE: "dark"
    }
    with pytest.raises(ValueError, match="guidance_scale must be >= 0"):
        companions_for(off, {1: {"guidance_scale": -2}})
    with pytest.raises(ValueError, match="reserved for CFG companions"):
        check_request_id("a::cfg_neg")


@pytest.mark.slow
@pytest.mark.forked
@pytest.mark.long(180, "a 2-rank DiT stage: two processes joining a gloo group, plus the one-rank reference")
def test_a_branch_failing_on_one_rank_fails_the_request_and_the_ranks_stay_in_step(tmp_path: Path) -> None:
    """Rank 1's forward raises once: that request fails on rank 0 (no hang in a collective the
    other rank left), and the next guided request on the same group is exact."""
    ns = f"dit2rraise{os.getpid()}"
    out = tmp_path
    caches = fake_cpu_caches(2, seed=5)
    plans = {}
    for i, rid in ((1, "a-1"), (4, "c-3")):
        plans[rid] = request_plan(i)
        plans[companion_request_id(rid, CFG_NEGATIVE)] = {
            **request_plan(i + 2),
            "purpose": CFG_NEGATIVE,
            "companion_of": rid,
        }
    sender = send_cfg_kv(ns, caches, plans)
    try:
        jobs = []
        for rid in ("a-1", "c-3"):
            cid = companion_request_id(rid, CFG_NEGATIVE)
            keys = {**sender.get_sender_info(rid)["keys"], **sender.get_sender_info(cid)["keys"]}
            jobs.append({"id": rid, "sender_info": {"keys": keys}, "scale": 3.0, "purposes": [CFG_NEGATIVE]})
        mp.start_processes(
            dit_rank_worker,
            args=(_free_port(), ns, jobs, str(out), 1, "pipeline_fixtures.RaiseOnceOnRank1"),
            nprocs=2,
            join=True,
            start_method="spawn",
        )
    finally:
        sender.shutdown()
    leader = json.loads((out / "rank0.json").read_text())
    follower = json.loads((out / "rank1.json").read_text())
    assert "exception" not in leader and "exception" not in follower, (leader, follower)
    assert not leader["a-1"]["ok"] and "other rank's guidance branch failed" in leader["a-1"]["error"]
    assert leader["c-3"]["ok"] and follower["served"] == 2
    from safetensors.torch import load_file

    torch.set_num_threads(1)
    module = TinyKVDiT(image_size=16, seed=0).eval()
    cid = companion_request_id("c-3", CFG_NEGATIVE)
    want = denoise(
        module,
        _ref(caches, plans["c-3"]),
        num_steps=3,
        seed=0,
        uncond_kv=_ref(caches, plans[cid]),
        guidance_scale=3.0,
    )[0]
    assert torch.equal(load_file(str(out / "c-3.safetensors"))["image"], want)
    assert _leftovers(ns) == []
