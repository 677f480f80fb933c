"""The tiny KV-conditioned DiT and the module loading of the diffusion runner (no engine)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from vllm_kvbridge.errors import ConfigError, RequestCancelled
from vllm_kvbridge.models.tiny_dit import TinyKVDiT
from vllm_kvbridge.runner.diffusion_batch import BatchRow, batch_forward_of, denoise_batch
from vllm_kvbridge.runner.diffusion_runner import build_module, denoise
from vllm_kvbridge.runner.settings import load_dotted


def _kv(seed: int, seq: int = 5, layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(seq, 2, 32, generator=g), torch.randn(seq, 2, 32, generator=g)) for _ in range(layers)
    ]


def test_same_seed_same_weights_and_other_seed_differs() -> None:
    a, b, c = TinyKVDiT(seed=0), TinyKVDiT(seed=0), TinyKVDiT(seed=1)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert any(not torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))
    # building the model does not disturb the caller's global RNG
    torch.manual_seed(123)
    x = torch.rand(3)
    torch.manual_seed(123)
    TinyKVDiT(seed=7)
    assert torch.equal(torch.rand(3), x)


def test_image_shape_range_and_dependence_on_kv() -> None:
    model = TinyKVDiT(image_size=16, seed=0).eval()
    img1 = denoise(model, _kv(1), num_steps=4, seed=0)
    img1_again = denoise(model, _kv(1), num_steps=4, seed=0)
    img2 = denoise(model, _kv(2), num_steps=4, seed=0)
    img_short = denoise(model, [(k[:3], v[:3]) for k, v in _kv(1)], num_steps=4, seed=0)
    assert img1.shape == (1, 3, 16, 16)
    assert torch.isfinite(img1).all() and img1.min() >= 0 and img1.max() <= 1
    assert torch.equal(img1, img1_again)
    assert not torch.allclose(img1, img2)  # the image is conditioned on the KV
    assert not torch.allclose(img1, img_short)  # ... on all of its tokens
    assert not torch.allclose(img1, denoise(model, _kv(1), num_steps=4, seed=1))


def test_wrong_kv_is_rejected_with_shapes() -> None:
    model = TinyKVDiT(seed=0)
    x = torch.zeros(1, *model.latent_shape)
    t = torch.ones(1)
    with pytest.raises(ValueError, match="needs the LLM's KV"):
        model(x, t, [])
    bad = [(torch.zeros(4, 4, 32), torch.zeros(4, 4, 32))]
    with pytest.raises(ValueError, match=r"KV layer 0: expected K and V of shape \[seq, 2, 32\]"):
        model(x, t, bad)
    with pytest.raises(ValueError, match="multiple of patch_size"):
        TinyKVDiT(image_size=30, patch_size=4)


def test_build_module_from_class_path_kwargs_and_weights(tmp_path) -> None:
    ref = TinyKVDiT(image_size=8, seed=3)
    weights = tmp_path / "dit.safetensors"
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(weights))
    built = build_module(
        "vllm_kvbridge.models.tiny_dit.TinyKVDiT", {"image_size": 8, "seed": 99}, str(weights)
    )
    for (name, a), b in zip(ref.state_dict().items(), built.state_dict().values()):
        assert torch.equal(a, b), name
    assert not built.training
    # "module:Class" spelling too
    assert isinstance(load_dotted("vllm_kvbridge.models.tiny_dit:TinyKVDiT"), type)


@pytest.mark.parametrize(
    ("path", "kwargs", "weights", "match"),
    [
        (
            "vllm_kvbridge.models.no_such_module.X",
            {},
            None,
            "No module named 'vllm_kvbridge.models.no_such_module'",
        ),
        ("vllm_kvbridge.models.tiny_dit.Nope", {}, None, "has no attribute 'Nope'"),
        ("vllm_kvbridge.models.tiny_dit.denoise_missing", {}, None, "has no attribute"),
        ("vllm_kvbridge.errors.ConfigError", {}, None, "not a torch.nn.Module subclass"),
        ("vllm_kvbridge.models.tiny_dit.TinyKVDiT", {"colour": 1}, None, "diffusion.kwargs"),
        ("vllm_kvbridge.models.tiny_dit.TinyKVDiT", {}, "/nonexistent/w.safetensors", "no such file"),
    ],
)
def test_build_module_errors(path, kwargs, weights, match) -> None:
    with pytest.raises(ConfigError, match=match):
        build_module(path, kwargs, weights)


def test_mismatched_weights_are_rejected(tmp_path) -> None:
    weights = tmp_path / "w.safetensors"
    save_file({"not_a_param": torch.zeros(2)}, str(weights))
    with pytest.raises(ConfigError, match="does not match"):
        build_module("vllm_kvbridge.models.tiny_dit.TinyKVDiT", {}, str(weights))


# -- batching (several requests denoised together) ----------------------------------------


class _RowsOnly(TinyKVDiT):
    """A user module that overrides ``forward`` and not ``forward_batch``: it is run row by
    row (its override is never bypassed). Records the batch of every call."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.calls: list[int] = []

    def forward(self, latents: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.calls.append(latents.shape[0])
        return super().forward(latents, *args, **kwargs)


class _Recording(TinyKVDiT):
    """TinyKVDiT that records the rows of every batched forward."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.calls: list[int] = []

    def forward_batch(self, latents: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.calls.append(latents.shape[0])
        return super().forward_batch(latents, *args, **kwargs)


def _rows(cancel_row: int | None = None, cancel_at: int = 2) -> list[BatchRow]:
    """Five requests: different prompt lengths and seeds, two guided (own scales and
    companions of their own lengths), one that repeats another's seed on other KV."""
    steps = iter(range(1000))
    rows = [
        BatchRow("a", _kv(1, seq=5), seed=0),
        BatchRow("b", _kv(2, seq=17), seed=1, uncond_kv=_kv(3, seq=4), guidance_scale=4.0),
        BatchRow("c", _kv(4, seq=1), seed=7),
        BatchRow("d", _kv(5, seq=9), seed=0, uncond_kv=_kv(6, seq=12), guidance_scale=2.5),
        BatchRow("e", _kv(7, seq=33), seed=3),
    ]
    if cancel_row is not None:
        rows[cancel_row].cancelled = lambda: next(steps) >= cancel_at
    return rows


def _unbatched(model: torch.nn.Module, row: BatchRow, num_steps: int) -> torch.Tensor:
    return denoise(
        model,
        row.kv,
        num_steps=num_steps,
        seed=row.seed,
        uncond_kv=row.uncond_kv,
        guidance_scale=row.guidance_scale,
    )[0]


def test_forward_batch_rows_equal_forward_each_on_its_own_kv() -> None:
    """Row r of ``forward_batch`` is ``forward`` of row r alone on its own KV: bit-exact on
    CPU (the per-row cross-attention and the per-distinct-t embedding see exactly the
    floats the batch-1 forward sees; measured max abs difference 0.0)."""
    model = TinyKVDiT(image_size=16, seed=0).eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, *model.latent_shape, generator=g)
    t = torch.tensor([1.0, 1.0, 0.5, 0.25])  # rows may sit at different steps
    kvs = [_kv(1, seq=5), _kv(2, seq=1), _kv(3, seq=20), _kv(1, seq=5)]
    with torch.inference_mode():
        batched = model.forward_batch(x, t, kvs, None)
        single = torch.cat([model(x[r : r + 1], t[r : r + 1], kvs[r]) for r in range(4)])
    assert (batched - single).abs().max().item() == 0.0
    assert torch.equal(batched, single)
    assert not torch.equal(batched[0], batched[3])  # same KV, other latents: other velocity
    with pytest.raises(ValueError, match="one KV per row: 4 rows, 3 KVs"):
        model.forward_batch(x, t, kvs[:3], None)
    with pytest.raises(ValueError, match=r"row 1: KV layer 0: expected K and V"):
        model.forward_batch(x[:2], t[:2], [kvs[0], [(torch.zeros(3, 4, 32), torch.zeros(3, 4, 32))]], None)


@pytest.mark.parametrize("module_cls", [_Recording, _RowsOnly])
def test_batched_denoise_equals_each_request_denoised_alone(module_cls: type) -> None:
    """Several requests with different prompt lengths, seeds and guidance (each guided
    one's unconditional rows on its own companion KV, mixed with its own scale) give each
    the image the unbatched ``denoise`` gives it: bit-exact on CPU. A module without
    batch support (``_RowsOnly``) is run row by row through its ``forward``."""
    model = module_cls(image_size=16, seed=0).eval()
    rows = _rows()
    out = denoise_batch(model, rows, num_steps=4)
    assert [type(o) for o in out] == [torch.Tensor] * 5
    worst = 0.0
    for row, img in zip(rows, out):
        want = _unbatched(TinyKVDiT(image_size=16, seed=0).eval(), row, 4)
        worst = max(worst, (img - want).abs().max().item())
        assert img.shape == (3, 16, 16)
        assert torch.equal(img, want), row.request_id
    assert worst == 0.0
    if module_cls is _Recording:
        # one forward per step: 5 conditional rows + 2 unconditional ones
        assert model.calls == [7, 7, 7, 7]
    else:
        assert model.calls == [1] * 7 * 4
    assert batch_forward_of(_Recording()) is not None and batch_forward_of(_RowsOnly()) is None


def test_an_aborted_row_leaves_the_batch_at_the_next_step_the_others_are_unaffected() -> None:
    model = _Recording(image_size=16, seed=0).eval()
    rows = _rows(cancel_row=1, cancel_at=2)  # the guided "b": asked before every step
    out = denoise_batch(model, rows, num_steps=5)
    assert isinstance(out[1], RequestCancelled) and "step 2 of 5" in str(out[1])
    # b's conditional and unconditional rows are gone from step 2 on
    assert model.calls == [7, 7, 5, 5, 5]
    for i in (0, 2, 3, 4):
        assert torch.equal(out[i], _unbatched(TinyKVDiT(image_size=16, seed=0).eval(), rows[i], 5))
    # every row aborted: the loop stops at once, nothing decoded
    rows = _rows()
    for r in rows:
        r.cancelled = lambda: True
    assert all(isinstance(o, RequestCancelled) for o in denoise_batch(model, rows, num_steps=5))


def test_a_forward_that_raises_fails_every_row_of_the_batch() -> None:
    class Broken(TinyKVDiT):
        def forward_batch(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            raise RuntimeError("injected: the module's batched forward failed")

    with pytest.raises(RuntimeError, match="injected"):
        denoise_batch(Broken(image_size=16).eval(), _rows(), num_steps=2)
