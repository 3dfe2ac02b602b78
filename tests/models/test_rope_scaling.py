"""RoPE scaling under Skrull: the static rope types equal one process, the batch-dependent ones
are shown to differ and refused unless no sequence passes their threshold.

transformers (5.24) computes ``"linear"``, ``"yarn"`` and ``"llama3"`` frequencies from the config
alone; ``"dynamic"`` and ``"longrope"`` recompute them in every forward from
``max(position_ids) + 1`` (``dynamic_rope_update``). Under Skrull that maximum is the one of the
rank's packed sequences and zigzag shards. Parity over a CP group of 2 processes is in the spawn
of ``test_engine.py``; this file runs one process (packing, and the rotary embedding fed each CP
rank's position ids).

Tolerances: float32, atol 1e-5 on losses and gradients, as the other model-level parity tests
(the packed micro-batch sums the same token terms in another order; measured <= 4.4e-7; float64
weights would not tighten it: the reference and transformers' loss take the logits to float32,
and the rotary embedding computes cos / sin in float32 whatever the model's dtype). The
rotary embedding's cos / sin are computed in float32 from each token's position alone, so for a
static type they are compared exactly (equal bits); the batch-dependent ones are shown to differ
by more than 1e-2.
"""

from __future__ import annotations

import copy

import pytest
import torch
from harness import one_rank_plan
from helpers import (
    ROPE_SENSITIVE,
    make_samples,
    max_grad_diff,
    reference_loss_and_grads,
    rope_parameters,
    tiny_config,
    tiny_model,
)
from torch import nn

from lightning_skrull.attention.layout import build_rank_layout
from lightning_skrull.data.collate import collate_rank
from lightning_skrull.models import (
    BATCH_DEPENDENT_ROPE_TYPES,
    STATIC_ROPE_TYPES,
    prepare_model,
    sequence_length_limit,
)
from lightning_skrull.runtime.engine import forward_backward, train_step
from lightning_skrull.runtime.process_groups import ParallelLayout
from lightning_skrull.scheduling import DISTRIBUTED, GlobalBatchPlan

ATOL = 1e-5
LENGTHS = [69, 5, 33, 2, 17]
# CP=1: two packed micro-batches, the 69-token sequence packed with two short ones.
PLAN = one_rank_plan((0, 1, 3), (2, 4), bucket_size=76)


def _packed_case(
    model: nn.Module, lengths: list[int], plan: GlobalBatchPlan, **prepare: int
) -> dict[str, float]:
    """Skrull loss / gradients of one CP=1 global batch vs each sequence run alone in plain HF.

    ``model`` is the plain HF model; a copy is prepared (with ``prepare`` as keyword arguments),
    or forced onto the Skrull attention without the checks when ``prepare`` has ``force=1``.
    """
    samples = make_samples(lengths, seed=3, prompt={0: 9, 2: 4})
    skrull = copy.deepcopy(model)
    if prepare.pop("force", 0):
        _force_skrull_attention(skrull)
    else:
        prepare_model(skrull, backend="sdpa", **prepare)
    ref_loss, ref_grads = reference_loss_and_grads(model, samples)
    batch = collate_rank(samples, plan, dp_rank=0, cp_rank=0, world_size=1)
    loss = float(forward_backward(skrull, batch, cp_group=None, backend="sdpa"))
    diff, where, scale = max_grad_diff(skrull, ref_grads)
    return {"loss": loss, "ref_loss": ref_loss, "grad_diff": diff, "scale": scale, "where": where}


def _assert_equal_to_reference(case: dict[str, float]) -> None:
    assert abs(case["loss"] - case["ref_loss"]) < ATOL, (case["loss"], case["ref_loss"])
    assert case["scale"] > 1e-2, "reference gradients too small to detect an error"
    assert case["grad_diff"] < ATOL, f"{case['where']} differs by {case['grad_diff']}"


def _unscaled_loss(arch: str) -> float:
    samples = make_samples(LENGTHS, seed=3, prompt={0: 9, 2: 4})
    return reference_loss_and_grads(tiny_model(arch, seed=4, **ROPE_SENSITIVE), samples)[0]


def test_rope_types_are_split_as_transformers_computes_them() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    # every type transformers knows is either accepted, batch-dependent, or refused as unknown
    assert STATIC_ROPE_TYPES == {"default", "linear", "yarn", "llama3"}
    assert set(BATCH_DEPENDENT_ROPE_TYPES) == {"dynamic", "longrope"}
    assert set(BATCH_DEPENDENT_ROPE_TYPES) | (STATIC_ROPE_TYPES - {"default"}) <= set(
        ROPE_INIT_FUNCTIONS
    )


def test_the_old_rope_scaling_key_is_read_as_rope_parameters() -> None:
    """Qwen2.5's recommended ``rope_scaling={"type": "yarn", ...}`` becomes ``rope_type="yarn"``."""
    config = tiny_config(
        "qwen2",
        rope_scaling={"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32},
    )
    assert config.rope_parameters["rope_type"] == "yarn"
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM(config)
    assert model.model.rotary_emb.rope_type == "yarn"
    prepare_model(model, backend="sdpa")
    dynamic = Qwen2ForCausalLM(
        tiny_config("qwen2", rope_scaling={"type": "dynamic", "factor": 4.0})
    )
    with pytest.raises(ValueError, match="RoPE type 'dynamic'"):
        prepare_model(dynamic, backend="sdpa")


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3", "mistral"])
@pytest.mark.parametrize("kind", ["linear", "yarn", "llama3"])
def test_static_rope_scaling_packed_on_one_rank_equals_reference(arch: str, kind: str) -> None:
    """Packed with a long neighbour, each sequence sees the frequencies it sees alone."""
    model = tiny_model(arch, seed=4, rope_parameters=rope_parameters(kind), **ROPE_SENSITIVE)
    assert model.model.rotary_emb.rope_type == kind
    assert sequence_length_limit(model) is None
    case = _packed_case(model, LENGTHS, PLAN)
    _assert_equal_to_reference(case)
    # the scaling really changes the model: not a test that passes by ignoring it
    assert abs(case["ref_loss"] - _unscaled_loss(arch)) > 1e-3


def _rotary(kind: str | None, **config: int) -> nn.Module:
    """A fresh rotary embedding (its dynamic state untouched) of a tiny Qwen2."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    params = {} if kind is None else {"rope_parameters": rope_parameters(kind)}
    return Qwen2RotaryEmbedding(tiny_config("qwen2", **params, **config))


def _cos(kind: str | None, positions: list[int] | tuple[int, ...], **config: int) -> torch.Tensor:
    x = torch.zeros(1, len(positions), 8)
    cos, _ = _rotary(kind, **config)(x, torch.tensor([positions]))
    return cos[0]


@pytest.mark.parametrize("kind", ["linear", "yarn", "llama3", "dynamic", "longrope"])
def test_rotary_frequencies_depend_on_the_packed_and_sharded_neighbours_only_for_dynamic_types(
    kind: str,
) -> None:
    """What the rotary embedding computes for one rank's packed / sharded positions.

    ``"dynamic"`` (``max_position_embeddings`` 32 here) and ``"longrope"`` (short factors up to
    32 positions): a 9-token sequence packed with a 60-token one gets the 60-token frequencies,
    and of a distributed 60-token sequence CP rank 1 (positions 15..44) computes other
    frequencies than CP rank 0 (0..14 and 45..59) and than one process. The static types give
    the same bits in every case.
    """
    config = {"max_position_embeddings": 32} if kind == "dynamic" else {}
    lengths = [9, 60]
    packed = build_rank_layout([0, 1], [0, 0], lengths, cp_rank=0, cp_size=1).position_ids
    alone = list(range(9))
    short_packed = _cos(kind, packed, **config)[:9]
    short_alone = _cos(kind, alone, **config)
    whole = _cos(kind, list(range(60)), **config)
    shard_diffs = []
    for cp_rank in range(2):
        layout = build_rank_layout([1], [DISTRIBUTED], lengths, cp_rank=cp_rank, cp_size=2)
        got = _cos(kind, layout.position_ids, **config)
        shard_diffs.append(float((got - whole[list(layout.position_ids)]).abs().max()))
    packed_diff = float((short_packed - short_alone).abs().max())
    if kind in STATIC_ROPE_TYPES:
        assert packed_diff == 0.0
        assert shard_diffs == [0.0, 0.0]
        return
    # the 9-token sequence alone keeps the initial frequencies; packed, it gets the long ones
    assert packed_diff > 1e-2
    # rank 0 holds position 59 and computes what one process computes; rank 1 (largest
    # position 44) grows dynamic NTK to 45 positions instead of 60, and longrope stays long
    # on both (45 > 32): equal there
    assert shard_diffs[0] == 0.0
    if kind == "dynamic":
        assert shard_diffs[1] > 1e-2
    else:
        assert shard_diffs[1] == 0.0
        # a 40-token sequence sharded: rank 1 holds 10..29, largest position 29 < 32: short
        ranks = [
            build_rank_layout([1], [DISTRIBUTED], [9, 40], cp_rank=r, cp_size=2).position_ids
            for r in range(2)
        ]
        whole = _cos(kind, list(range(40)))
        assert float((_cos(kind, ranks[1]) - whole[list(ranks[1])]).abs().max()) > 1e-2


def _force_skrull_attention(model: nn.Module) -> nn.Module:
    """The Skrull attention without prepare_model's checks (to show what they prevent)."""
    from lightning_skrull.attention.dispatch import register_skrull_attention

    register_skrull_attention()
    model.set_attn_implementation("skrull")
    model.config.use_cache = False
    return model


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_batch_dependent_rope_packed_differs_from_one_process(kind: str) -> None:
    """Forced past the refusal, packing a 9-token sequence after a 60-token one changes the loss."""
    config = {"max_position_embeddings": 32} if kind == "dynamic" else {}
    model = tiny_model(
        "qwen2", seed=4, rope_parameters=rope_parameters(kind), **config, **ROPE_SENSITIVE
    )
    plan = one_rank_plan((0, 1), bucket_size=69)
    case = _packed_case(model, [60, 9], plan, force=1)
    # measured: loss off by 2.1e-3 (dynamic) and 5.1e-2 (longrope), gradients by 1.9e-2 and 0.15
    assert abs(case["loss"] - case["ref_loss"]) > 1e-3
    assert case["grad_diff"] > 1e-2


@pytest.mark.parametrize(
    ("kind", "config", "limit", "longest", "refused"),
    [
        ("dynamic", {}, 256, None, "no max_sequence_length was given"),
        ("dynamic", {"max_position_embeddings": 64}, 64, 65, "max_sequence_length=65 exceeds it"),
        ("dynamic", {"max_position_embeddings": 64}, 64, 64, None),
        ("longrope", {}, 32, None, "no max_sequence_length was given"),
        ("longrope", {}, 32, 33, "max_sequence_length=33 exceeds it"),
        ("longrope", {}, 32, 32, None),
    ],
)
def test_batch_dependent_rope_is_refused_unless_no_sequence_reaches_the_threshold(
    kind: str, config: dict[str, int], limit: int, longest: int | None, refused: str | None
) -> None:
    model = tiny_model("qwen2", rope_parameters=rope_parameters(kind), **config)
    field = BATCH_DEPENDENT_ROPE_TYPES[kind]
    if refused is not None:
        with pytest.raises(
            ValueError,
            match=rf"Qwen2ForCausalLM cannot .*RoPE type '{kind}' .*largest position id.*"
            rf"{field}={limit}.*{refused} \(promise .*max_sequence_length<={limit}\).*"
            r"rope type whose frequencies depend on the config only: 'default', 'linear', "
            r"'llama3', 'yarn'",
        ):
            prepare_model(model, backend="sdpa", max_sequence_length=longest)
        return
    prepare_model(model, backend="sdpa", max_sequence_length=longest)
    assert sequence_length_limit(model) == limit
    # train_step checks every global batch against the promise
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    layout = ParallelLayout(rank=0, world_size=1, dp_size=1, cp_size=1, dp_rank=0, cp_rank=0)
    with pytest.raises(
        ValueError,
        match=rf"sequence 1 has {limit + 1} tokens, more than the {limit} tokens up to which the "
        rf"'{kind}' RoPE of Qwen2ForCausalLM keeps its frequencies",
    ):
        train_step(
            model,
            optimizer,
            make_samples([4, limit + 1], seed=0),
            layout=layout,
            bucket_size=2 * limit,
        )


def test_unknown_rope_type_and_grown_dynamic_rope_are_refused() -> None:
    proportional = tiny_model("qwen2", rope_parameters={"rope_type": "proportional"})
    with pytest.raises(
        ValueError, match=r"RoPE type 'proportional' is not one whose frequencies Skrull knows"
    ):
        prepare_model(proportional, backend="sdpa")
    grown = tiny_model(
        "qwen2", rope_parameters=rope_parameters("dynamic"), max_position_embeddings=32
    )
    with torch.no_grad():
        grown(torch.zeros(1, 40, dtype=torch.long))  # dynamic NTK grows to 40 positions
    with pytest.raises(ValueError, match=r"grown by an earlier forward over 40 positions"):
        prepare_model(grown, backend="sdpa", max_sequence_length=32)
    # a promise below the threshold is exact: every forward resets the grown frequencies
    prepare_model(grown, backend="sdpa", max_sequence_length=31)


@pytest.mark.parametrize(
    ("kind", "config", "longest"),
    [
        ("dynamic", {"max_position_embeddings": 69}, 69),
        ("longrope", {"max_position_embeddings": 256}, 32),
    ],
)
def test_batch_dependent_rope_within_its_threshold_packed_equals_reference(
    kind: str, config: dict[str, int], longest: int
) -> None:
    """Below the threshold the initial frequencies hold: dynamic NTK's are the unscaled ones,
    longrope's the short factors (and its attention factor), both exact under packing."""
    lengths = [min(n, longest) for n in LENGTHS]
    model = tiny_model(
        "qwen2", seed=4, rope_parameters=rope_parameters(kind), **config, **ROPE_SENSITIVE
    )
    case = _packed_case(model, lengths, PLAN, max_sequence_length=longest)
    _assert_equal_to_reference(case)
    samples = make_samples(lengths, seed=3, prompt={0: 9, 2: 4})
    unscaled = reference_loss_and_grads(
        tiny_model("qwen2", seed=4, **config, **ROPE_SENSITIVE), samples
    )[0]
    if kind == "dynamic":
        assert case["ref_loss"] == unscaled  # the base frequencies, bit for bit
    else:
        assert abs(case["ref_loss"] - unscaled) > 1e-3


def test_cost_model_and_memory_estimate_do_not_depend_on_the_rope_type() -> None:
    """Both read the model's shape only: a rope type changes the frequencies, not the FLOPs or
    the activations (cos / sin are ``[tokens, head_dim]`` for every type)."""
    from benchmarks.memory_estimate import activation_bytes_per_token
    from lightning_skrull.scheduling import CostModel

    plain = tiny_config("qwen2")
    for kind in ("linear", "yarn", "llama3", "dynamic", "longrope"):
        scaled = tiny_config("qwen2", rope_parameters=rope_parameters(kind))
        assert CostModel.from_hf_config(scaled) == CostModel.from_hf_config(plain)
        for chunked in (False, True):
            assert activation_bytes_per_token(
                scaled, chunked_loss=chunked
            ) == activation_bytes_per_token(plain, chunked_loss=chunked)
