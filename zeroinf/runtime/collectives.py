"""The two flat collectives under the names of the installed torch: torch 2.13 renamed
``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``all_gather_single`` /
``reduce_scatter_single`` and warns (FutureWarning) on every call of the old names, which
torch 2.4-2.12 only have. Same signatures: ``(output, input, [op,] group=None, async_op=False)``."""
import torch.distributed as dist

__all__ = ["all_gather_single", "reduce_scatter_single"]

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
