"""The tiny KV-conditioned DiT and the module loading of the diffusion runner (no engine)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from vllm_kvbridge.errors import ConfigError
from vllm_kvbridge.models.tiny_dit import TinyKVDiT
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
