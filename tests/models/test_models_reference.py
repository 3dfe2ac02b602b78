"""The single-process reference every parity test compares against (``helpers.py``), checked
against transformers' own loss.

The reference never packs, shards or uses the Skrull attention: it runs each sequence of a
global batch alone through the plain Hugging Face model (eager attention), takes the standard
shifted cross-entropy summed over supervised tokens, and divides by the supervised tokens of the
whole global batch.
"""

from __future__ import annotations

import torch
from helpers import make_samples, max_grad_diff, reference_loss_and_grads, tiny_model


def test_reference_matches_transformers_loss_on_one_batch() -> None:
    """The reference equals transformers' own loss and gradients on a padded-free batch.

    Two sequences of equal length run as one HF batch with ``labels`` (HF shifts them and takes
    the mean over supervised tokens); the reference runs them one by one. Float32, same kernels
    up to the batch dimension: atol 1e-6.
    """
    model = tiny_model("qwen2", seed=3)
    samples = make_samples([9, 9], seed=4, prompt={0: 3})
    ref_loss, ref_grads = reference_loss_and_grads(model, samples)
    ids = torch.tensor([s["input_ids"] for s in samples])
    labels = torch.tensor([s["labels"] for s in samples])
    out = model(input_ids=ids, labels=labels, use_cache=False)
    out.loss.backward()
    assert abs(float(out.loss.detach()) - ref_loss) < 1e-6
    diff, where, scale = max_grad_diff(model, ref_grads)
    assert scale > 1e-3
    assert diff < 1e-6, f"{where} differs by {diff}"
