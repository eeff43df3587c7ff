"""Stage 3's working set: the parameters a rank holds gathered on its device at once.

A stage-3 rank keeps only partitions; for compute it gathers whole units (see
``zeroinf/runtime/stage3/units.py``): the persistent unit (parameters under
``stage3_param_persistence_threshold`` elements, gathered once and kept), the root unit (every
parameter outside the transformer blocks, gathered for the whole forward and backward) and one
unit per block. Two neighbouring blocks are in use at once: in the backward a block stays
gathered until its gradients are reduced, and the backward of the block before it has begun by
then. What is gathered besides them is bounded by three keys of ``zero_optimization``
(``zeroinf/runtime/stage3/prefetch.py``, ``manager.py``):

* ``stage3_prefetch_bucket_size``: the scheduler gathers the next blocks of the trace ahead of
  use, whole blocks in order, while their elements fit in the bucket (0: no prefetch);
* ``stage3_max_reuse_distance``: a block requested again within that many gathered elements is
  kept after use. In the forward, block ``j`` of ``L`` is next requested by the backward, after
  the blocks behind it run forward and then backward: ``2 x sum(blocks[j+1:])`` elements, so at
  the turn from forward to backward the last blocks within that distance are all gathered;
* ``stage3_max_live_parameters``: the engine never holds more non-persistent elements gathered
  (it releases prefetched and kept blocks first, and refuses at start-up a limit below the root
  unit plus the largest block).

Units: elements (parameters), not bytes; the estimator multiplies by bytes per element.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Tuple

__all__ = ["GatherLimits", "working_set"]


@dataclass(frozen=True)
class GatherLimits:
    """The ``zero_optimization`` keys that bound stage 3's working set, elements; defaults are
    :class:`zeroinf.config.ZeroConfig`'s (DeepSpeed's)."""

    prefetch_bucket_size: int = 50_000_000
    max_live_parameters: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000

    @classmethod
    def from_zero_config(cls, zero) -> "GatherLimits":
        """From a parsed ``zero_optimization`` block (:class:`zeroinf.config.ZeroConfig`)."""
        return cls(prefetch_bucket_size=zero.stage3_prefetch_bucket_size,
                   max_live_parameters=zero.stage3_max_live_parameters,
                   max_reuse_distance=zero.stage3_max_reuse_distance)


def _run(blocks: Sequence[int], start: int, step: int, bucket: int) -> int:
    """Elements of the whole blocks from ``start`` on (direction ``step``) that fit in ``bucket``."""
    total, i = 0, start
    while 0 <= i < len(blocks) and total + blocks[i] <= bucket:
        total += blocks[i]
        i += step
    return total


def working_set(persistent: int, root: int, blocks: Sequence[int],
                limits: GatherLimits = GatherLimits()) -> Tuple[int, str]:
    """Elements a stage-3 rank holds gathered at once, and the formula with its numbers.

    Args:
        persistent, root: elements of the persistent and the root unit.
        blocks: elements of each block unit, in module order (the forward's order).
        limits: the bounding keys.

    Returns:
        ``(elements, formula)``: ``persistent + min(max_live, max(root + b_i + b_i+1 + ahead_i,
        root + kept))`` over neighbouring blocks ``b_i``, ``b_i+1``, where ``ahead_i`` is the most
        elements of whole blocks beyond the pair (either direction: forward or backward) that fit
        in the prefetch bucket, and ``kept`` the blocks gathered at the forward-to-backward turn
        (within the reuse distance, the last block included); never below ``persistent + root +
        max(blocks)``, which the engine needs and checks. ``engine.stats()``'s
        ``live_high_water`` is this figure less ``persistent``.
    """
    blocks = [b for b in blocks if b > 0]
    largest = max(blocks, default=0)
    bucket = limits.prefetch_bucket_size
    steady, at = largest, None
    for i in range(max(len(blocks) - 1, 1) if blocks else 0):
        pair = sum(blocks[i:i + 2])
        ahead = max(_run(blocks, i + 2, 1, bucket), _run(blocks, i - 1, -1, bucket)) if bucket > 0 else 0
        if pair + ahead > steady:
            steady, at = pair + ahead, i
    kept, after = 0, 0
    for b in reversed(blocks):
        if 2 * after > limits.max_reuse_distance:
            break
        kept += b
        after += b
    gathered = min(limits.max_live_parameters, max(steady, kept, largest) + root)
    gathered = max(gathered, root + largest)
    total = persistent + gathered
    formula = (f"persistent {persistent:,} + min(max_live {limits.max_live_parameters:,}, root {root:,} + "
               f"max(blocks in use with prefetched ones {steady:,}"
               + (f" (blocks {at}, {at + 1} and {steady - sum(blocks[at:at + 2]):,} ahead within bucket {bucket:,})"
                  if at is not None else "")
               + f", blocks kept at the forward/backward turn within reuse distance {limits.max_reuse_distance:,}: "
               f"{kept:,})) = {total:,}")
    return total, formula
