"""Floor 1, figures across ranks: whole logical parameters under DTensor/FSDP2, process groups, pipeline stages and
expert groups (``reduce``), the row layout the ranks agree on (``_layout``) and what is reduced over which group
(``_reduce_plan``).
"""

from torch_gradstats.distributed.reduce import (
    ReducedStats,
    is_logging_rank,
    reduce_across_ranks,
)

__all__ = [
    "ReducedStats",
    "is_logging_rank",
    "reduce_across_ranks",
]
