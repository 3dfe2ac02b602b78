"""What autograd keeps: the measurements the activation-memory estimate is checked against.

- :func:`kept_bytes`: the bytes of every tensor autograd still holds after a forward (each
  storage once), by a saved-tensors hook whose handles die with the tensors autograd drops;
- :func:`layer_per_token`: one decoder layer's bytes per token, two layers less one at two token
  counts (so every constant cancels);
- :func:`prepared_layer_per_token`: that, for the prepared model (``prepare_model``, the
  ``sdpa`` backend at CP 1, the attention training runs).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection
from typing import Any

import torch
from helpers import make_samples
from transformers import AutoModelForCausalLM

from lightning_skrull.data.collate import collate_rank
from lightning_skrull.models import prepare_model
from lightning_skrull.runtime.engine import micro_batch_context
from lightning_skrull.scheduling.plan import GlobalBatchPlan, MicroBatchPlan


class Held:
    """What the saved-tensors hook hands autograd: dies when autograd drops the tensor, by
    reference counting (the graph holds no reference cycle, so the count needs no
    ``gc.collect()``, which takes a second per call with the whole suite's objects alive)."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def kept_bytes(
    forward: Callable[[], Any],
    skip: Collection[int],
    ignore: Callable[[torch.Tensor], bool] = lambda tensor: False,
) -> int:
    """Bytes of every tensor autograd still holds after ``forward()`` (its output alive), each
    storage once, the storages whose data pointers are in ``skip`` (parameters, say) and the
    tensors ``ignore`` picks left out. Unlike counting every tensor saved, this leaves out what a
    node saved that the graph then dropped."""
    held: list[weakref.ref[Held]] = []

    def pack(t: torch.Tensor) -> Held:
        h = Held(t)
        held.append(weakref.ref(h))
        return h

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda h: h.tensor):
        out = forward()
    kept = {}
    for ref in held:
        h = ref()
        if h is None or ignore(h.tensor):
            continue
        ptr = h.tensor.untyped_storage().data_ptr()
        if ptr not in skip:
            kept[ptr] = h.tensor.untyped_storage().nbytes()
    del out
    return sum(kept.values())


def layer_per_token(measure: Callable[[int, int], float], tokens: tuple[int, int]) -> float:
    """One decoder layer's bytes per token: ``measure(layers, tokens)`` of two layers less one,
    at the longer of ``tokens`` less the shorter."""
    short, long = tokens
    at = {(layers, n): measure(layers, n) for layers in (1, 2) for n in (short, long)}
    return (at[2, long] - at[2, short] - at[1, long] + at[1, short]) / (long - short)


def _prepared_kept_bytes(config: Any, tokens: int, dtype: torch.dtype) -> int:
    """Bytes autograd still holds after a forward of one ``tokens``-token sequence through the
    prepared model (``prepare_model``, the ``sdpa`` backend, CP 1: the attention training
    runs), each storage once, parameters left out. Also left out: the causal mask of an
    attention-sink call, a ``tokens x (tokens + 1)`` tensor that SDPA's CPU kernel saves (on
    CUDA the call takes a lower-right causal bias, no tensor); it is not per token."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    model = prepare_model(model, backend="sdpa", chunked_loss=True)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    plan = GlobalBatchPlan(micro_batches=((MicroBatchPlan((0,), (0,)),),), dp_size=1, cp_size=1,
                           bucket_size=tokens, policy="hand")  # fmt: skip
    batch = collate_rank(make_samples([tokens], seed=1), plan, dp_rank=0, cp_rank=0, world_size=1)
    mb = batch.micro_batches[0]

    def forward() -> Any:
        with micro_batch_context(mb, None, "sdpa"):
            return model(**mb.inputs)

    return kept_bytes(forward, params, lambda t: t.shape == (tokens, tokens + 1))


def prepared_layer_per_token(config: Callable[[int], Any], dtype: torch.dtype) -> float:
    """Kept bytes per token of one decoder layer of the prepared model: the model of
    ``config(2)`` (two layers) less that of ``config(1)``, at 256 tokens less 128."""
    return layer_per_token(
        lambda layers, tokens: _prepared_kept_bytes(config(layers), tokens, dtype), (128, 256)
    )
