"""Memory fitting for bucket_size='auto': pure parts on recorded numbers."""

from __future__ import annotations

import pytest
import torch

from lightning_skrull.runtime.memory import (
    MemoryFit,
    choose_bucket_size,
    fit_memory_model,
    probe_peak_memory,
)

GIB = 2**30

# Synthetic probe readings shaped like a small-model step (no GPU measurement was available when
# this was written): about 3.9 GiB fixed plus ~0.55 MiB per token, with allocator-like noise.
RECORDED_TOKENS = [2048, 4096, 8192, 16384]
RECORDED_PEAKS = [5.02 * GIB, 6.11 * GIB, 8.32 * GIB, 12.71 * GIB]


def test_fit_recovers_an_exact_line() -> None:
    # Exact data: alpha and beta come back to float rounding (rel 1e-12).
    tokens = [100, 200, 400]
    fit = fit_memory_model(tokens, [3.0 * t + 1000.0 for t in tokens])
    assert fit.alpha == pytest.approx(3.0, rel=1e-12)
    assert fit.beta == pytest.approx(1000.0, rel=1e-12)
    assert fit.max_relative_error < 1e-12


def test_fit_on_recorded_numbers_is_close_and_picks_a_safe_bucket() -> None:
    fit = fit_memory_model(RECORDED_TOKENS, RECORDED_PEAKS)
    # The recorded points lie within 1% of a line (noise of the allocator).
    assert fit.max_relative_error < 0.01
    capacity = 80 * GIB
    bucket = choose_bucket_size(fit, capacity, safety_margin=0.1, multiple_of=128)
    assert bucket % 128 == 0
    assert fit.predict(bucket) <= 0.9 * capacity
    assert fit.predict(bucket + 128) > 0.9 * capacity


def test_bad_fits_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="two or more distinct token counts"):
        fit_memory_model([100, 100], [1.0, 2.0])
    with pytest.raises(ValueError, match="one peak-memory reading per probe"):
        fit_memory_model([100, 200], [1.0])
    with pytest.raises(ValueError, match="not positive"):
        fit_memory_model([100, 200], [2.0, 1.0])


def test_choose_refuses_when_the_model_alone_does_not_fit() -> None:
    fit = MemoryFit(alpha=1000.0, beta=79 * GIB, max_relative_error=0.0)
    with pytest.raises(ValueError, match="No bucket"):
        choose_bucket_size(fit, 80 * GIB, safety_margin=0.1)
    with pytest.raises(ValueError, match="safety_margin"):
        choose_bucket_size(fit, 80 * GIB, safety_margin=1.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_probe_refuses_without_cuda() -> None:
    with pytest.raises(RuntimeError, match="needs a GPU"):
        probe_peak_memory(lambda tokens: None, [128, 256])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_probe_measures_growing_peaks_on_cuda() -> None:
    def step(tokens: int) -> None:
        x = torch.randn(tokens, 1024, device="cuda", requires_grad=True)
        (x * x).sum().backward()

    peaks = probe_peak_memory(step, [1024, 4096, 16384])
    fit = fit_memory_model([1024, 4096, 16384], peaks)
    assert fit.alpha > 1024 * 4  # at least one fp32 activation row per token
