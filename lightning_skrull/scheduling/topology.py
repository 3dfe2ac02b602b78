"""Which links a CP block's exchange crosses: a question of rank numbers.

CP groups are innermost in the rank order: global rank ``dp_rank * cp_size + cp_rank``. Nodes
hold ``ranks_per_node`` consecutive global ranks. A CP group either sits inside one node
(``ranks_per_node % cp_size == 0``) or spans whole nodes (``cp_size % ranks_per_node == 0``);
any other layout would put the CP groups of different DP ranks on different link mixes and is
refused (:func:`check_topology`).
"""

from __future__ import annotations


def check_ranks_per_node(ranks_per_node: object, owner: str = "CostModel.") -> None:
    """Refuse a ``ranks_per_node`` that is neither ``None`` nor an int >= 1.

    Raises:
        ValueError: naming the value, the rule and the fix.
    """
    if ranks_per_node is None:
        return
    if (
        isinstance(ranks_per_node, bool)
        or not isinstance(ranks_per_node, int)
        or ranks_per_node < 1
    ):
        raise ValueError(
            f"{owner}ranks_per_node={ranks_per_node!r} is invalid; give the GPUs of one node "
            "(an int >= 1), or None when the whole CP group shares one node's links."
        )


def check_topology(ranks_per_node: int | None, *, dp_size: int, cp_size: int) -> None:
    """Refuse a ``ranks_per_node`` that does not fit a ``dp_size x cp_size`` layout.

    Raises:
        ValueError: when it does not divide the world size, or when a CP group neither sits
            inside one node nor spans whole nodes; naming the values, the rule and the fix.
    """
    check_ranks_per_node(ranks_per_node)
    if ranks_per_node is None:
        return
    world = dp_size * cp_size
    if world % ranks_per_node:
        raise ValueError(
            f"CostModel.ranks_per_node={ranks_per_node} does not divide the world size "
            f"(dp_size * cp_size = {dp_size} * {cp_size} = {world}); give the GPUs per node "
            "of the launch, or None."
        )
    if ranks_per_node % cp_size and cp_size % ranks_per_node:
        raise ValueError(
            f"CostModel.ranks_per_node={ranks_per_node} does not fit CP groups of {cp_size} "
            "ranks: a CP group must sit inside one node (ranks_per_node % cp_size == 0) or "
            "span whole nodes (cp_size % ranks_per_node == 0); change cp_size or the launch."
        )


def spans_nodes(
    cp_ranks: range, *, cp_size: int, ranks_per_node: int | None, dp_rank: int = 0
) -> bool:
    """Whether the CP ranks ``cp_ranks`` of DP rank ``dp_rank``'s CP group sit on more than one
    node (``ranks_per_node=None``: never). In a layout :func:`check_topology` accepts, the
    answer is the same for every DP rank."""
    if ranks_per_node is None or len(cp_ranks) < 2:
        return False
    first = dp_rank * cp_size + cp_ranks.start
    last = dp_rank * cp_size + cp_ranks.stop - 1
    return first // ranks_per_node != last // ranks_per_node
