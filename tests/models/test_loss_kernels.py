"""The fused CUDA loss kernels (Liger Kernel, Cut Cross-Entropy) behind the chunked loss.

Which kernel runs is a pure decision (:func:`resolve_loss_kernel`), tested everywhere. The
adapter that calls a fused kernel is tested on CPU against the dense loss by standing in for the
kernel packages with modules that compute the dense loss with the same call contract (the
fused kernels' own arithmetic is theirs and needs CUDA); on CUDA with a package installed, the
real kernel is tested against the same dense reference.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lightning_skrull.models import loss_kernels
from lightning_skrull.models.chunked_loss import use_chunked_loss
from lightning_skrull.models.loss_kernels import (
    check_loss_kernel,
    installed_fused_kernels,
    linear_cross_entropy,
    resolve_loss_kernel,
)

FP32_REL = 1e-6  # the same terms summed in another order (measured below 2e-7)


def _dense_sum(hidden: Any, weight: Any, target: Any, bias: Any = None) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias).float()
    return F.cross_entropy(logits, target, ignore_index=-100, reduction="sum")


class _Recorder:
    """Stands in for a fused kernel: the dense loss, and what it was called with."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, hidden: Any, weight: Any, target: Any, **kwargs: Any) -> torch.Tensor:
        self.calls.append(
            {"dtypes": (hidden.dtype, weight.dtype), "autocast": torch.is_autocast_enabled("cpu")}
            | kwargs
        )
        assert kwargs["reduction"] == "sum" and kwargs["ignore_index"] == -100
        return _dense_sum(hidden, weight, target, kwargs.get("bias"))


@pytest.fixture
def fake_kernels(monkeypatch: pytest.MonkeyPatch) -> dict[str, _Recorder]:
    liger, cce = _Recorder(), _Recorder()
    functional = types.ModuleType("liger_kernel.transformers.functional")
    functional.liger_fused_linear_cross_entropy = liger  # type: ignore[attr-defined]
    cce_module = types.ModuleType("cut_cross_entropy")
    cce_module.linear_cross_entropy = cce  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", functional)
    monkeypatch.setitem(sys.modules, "cut_cross_entropy", cce_module)
    return {"liger": liger, "cce": cce}


def test_auto_picks_a_fused_kernel_only_on_cuda() -> None:
    both = ("liger", "cce")
    assert resolve_loss_kernel("auto", "cpu", torch.bfloat16, both) == "chunked"
    assert resolve_loss_kernel("auto", "cuda", torch.bfloat16, both) == "liger"
    assert resolve_loss_kernel("auto", "cuda", torch.bfloat16, ("cce",)) == "cce"
    # Cut Cross-Entropy's kernels take 16-bit inputs: a float32 run stays chunked
    assert resolve_loss_kernel("auto", "cuda", torch.float32, ("cce",)) == "chunked"
    assert resolve_loss_kernel("auto", "cuda", torch.bfloat16, ()) == "chunked"
    assert resolve_loss_kernel("chunked", "cuda", torch.bfloat16, both) == "chunked"
    assert resolve_loss_kernel("cce", "cuda", torch.float16, both) == "cce"


def test_bad_kernel_requests_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"'fused'.*is unknown.*'auto', 'chunked'"):
        check_loss_kernel("fused")
    with pytest.raises(ValueError, match=r"'liger' needs the liger-kernel package.*pip install"):
        check_loss_kernel("liger", installed=())
    with pytest.raises(ValueError, match=r"'cce' runs on CUDA only.*'cpu'.*\"chunked\""):
        resolve_loss_kernel("cce", "cpu", torch.bfloat16, ("cce",))


def test_a_missing_package_is_refused_when_the_model_is_prepared() -> None:
    from helpers import TINY_QWEN2
    from transformers import Qwen2Config, Qwen2ForCausalLM

    missing = [k for k in ("liger", "cce") if k not in installed_fused_kernels()]
    if not missing:
        pytest.skip("both fused kernel packages are installed here")
    with pytest.raises(ValueError, match="pip install"):
        use_chunked_loss(Qwen2ForCausalLM(Qwen2Config(**TINY_QWEN2)), kernel=missing[0])


@pytest.mark.parametrize("kernel", ["liger", "cce"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("num_items", [None, 11.0])
def test_fused_adapter_equals_the_dense_loss(
    kernel: str,
    with_bias: bool,
    num_items: float | None,
    fake_kernels: dict[str, _Recorder],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the device check is the one thing a CPU run cannot pass: pin the decision to the kernel
    monkeypatch.setattr(loss_kernels, "resolve_loss_kernel", lambda *a, **k: kernel)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 9, 16, generator=g, requires_grad=True)
    weight = (torch.randn(50, 16, generator=g) * 0.3).requires_grad_()
    bias = (torch.randn(50, generator=g) * 0.1).requires_grad_() if with_bias else None
    target = torch.randint(0, 50, (2, 9), generator=g)
    target[0, :4] = -100
    got = linear_cross_entropy(
        hidden, weight, target, bias=bias, num_items_in_batch=num_items, kernel=kernel
    )
    got.backward()
    ref_in = [t.detach().clone().requires_grad_() for t in (hidden, weight)]
    ref_bias = None if bias is None else bias.detach().clone().requires_grad_()
    total = _dense_sum(ref_in[0].reshape(-1, 16), ref_in[1], target.reshape(-1), ref_bias)
    ref = total / (num_items if num_items is not None else (target != -100).sum())
    ref.backward()
    assert float(got.detach()) == pytest.approx(float(ref), rel=FP32_REL)
    for a, b in [(hidden, ref_in[0]), (weight, ref_in[1])] + (
        [(bias, ref_bias)] if bias is not None else []
    ):
        assert a.grad is not None and b.grad is not None
        assert torch.allclose(a.grad, b.grad, rtol=FP32_REL, atol=1e-7)
    (call,) = fake_kernels[kernel].calls
    assert call["dtypes"] == (torch.float32, torch.float32) and not call["autocast"]
    # Liger sums the head's gradient over its chunks in float32, as the chunked path does
    assert call.get("accum_dtype") == (torch.float32 if kernel == "liger" else None)


def test_an_older_liger_without_accum_dtype_is_called_without_it(
    fake_kernels: dict[str, _Recorder], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[dict[str, Any]] = []

    def old_liger(
        hidden: Any, weight: Any, target: Any, bias: Any = None, ignore_index: int = -100,
        reduction: str = "mean",
    ) -> torch.Tensor:  # fmt: skip
        calls.append({"reduction": reduction, "ignore_index": ignore_index})
        return _dense_sum(hidden, weight, target, bias)

    module = sys.modules["liger_kernel.transformers.functional"]
    monkeypatch.setattr(module, "liger_fused_linear_cross_entropy", old_liger)
    monkeypatch.setattr(loss_kernels, "resolve_loss_kernel", lambda *a, **k: "liger")
    hidden, weight = torch.randn(5, 8), torch.randn(20, 8)
    target = torch.randint(0, 20, (5,))
    loss = linear_cross_entropy(hidden, weight, target, kernel="liger")
    assert calls == [{"reduction": "sum", "ignore_index": -100}]
    assert float(loss) == pytest.approx(float(_dense_sum(hidden, weight, target) / 5), rel=FP32_REL)


def test_fused_adapter_runs_in_the_autocast_dtype_with_autocast_off(
    fake_kernels: dict[str, _Recorder], monkeypatch: pytest.MonkeyPatch
) -> None:
    # as lm_head would under autocast: bf16 inputs, the float32 master weight cast once
    monkeypatch.setattr(loss_kernels, "resolve_loss_kernel", lambda *a, **k: "liger")
    hidden = torch.randn(6, 8, requires_grad=True)
    weight = torch.randn(20, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(hidden, weight, torch.randint(0, 20, (6,)), kernel="liger")
    loss.backward()
    (call,) = fake_kernels["liger"].calls
    assert call["dtypes"] == (torch.bfloat16, torch.bfloat16) and not call["autocast"]
    assert loss.dtype == torch.float32 and weight.grad is not None
    assert weight.grad.dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused kernels run on CUDA only")
@pytest.mark.parametrize("kernel", ["liger", "cce"])
def test_real_fused_kernel_on_cuda_is_as_close_as_the_chunked_path(kernel: str) -> None:
    if kernel not in installed_fused_kernels():
        pytest.skip(f"{kernel} is not installed")
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(300, 64, device="cuda", generator=g)
    weight = torch.randn(1000, 64, device="cuda", generator=g) * 0.1
    target = torch.randint(0, 1000, (300,), device="cuda", generator=g)
    target[::5] = -100
    ref = _dense_sum(hidden.double(), weight.double(), target) / (target != -100).sum()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        chunked = linear_cross_entropy(hidden, weight, target, kernel="chunked")
        fused = linear_cross_entropy(hidden, weight, target, kernel=kernel)
    # both run the head in bf16; the fused kernel may be up to 2x as far from float64 as the
    # chunked path, plus one bf16 rounding of the loss (the precision matrix's rule)
    assert abs(float(fused) - float(ref)) <= 2 * abs(float(chunked) - float(ref)) + 2**-8 * float(
        ref
    )


def test_the_strategies_refuse_a_kernel_that_cannot_run_when_built() -> None:
    from lightning_skrull import SkrullStrategy

    with pytest.raises(ValueError, match=r"'fast'.*is unknown"):
        SkrullStrategy(loss_kernel="fast")
    missing = [k for k in ("liger", "cce") if k not in installed_fused_kernels()]
    if missing:
        with pytest.raises(ValueError, match="pip install"):
            SkrullStrategy(loss_kernel=missing[0])
    # with the dense loss the kernel is never used, so it is not checked
    assert SkrullStrategy(chunked_loss=False, loss_kernel="liger").skrull_config.loss_kernel
