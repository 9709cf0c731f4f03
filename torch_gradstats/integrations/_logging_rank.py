"""Which process writes: the arguments ``stage_group=``, ``group=`` and ``log_rank=`` every sink takes.

Under pipeline parallelism every rank holds the figures of the whole model (``grad_stats(..., stage_group=)``
gathers every stage's rows on every rank), so one rank is enough to write them: by default the last stage's, where
the loss is, as torchtitan and Megatron log (:func:`torch_gradstats.distributed.reduce.is_logging_rank`). Deciding costs
no communication; it is decided once, when the sink is made.
"""

from __future__ import annotations

import numbers
from typing import Any


def writes_here(who: str, stage_group: Any, group: Any, log_rank: Any) -> bool:
    """Whether this process writes. With none of the three given, True: the sink writes wherever it is called (one
    process, or the caller decides). Otherwise ``is_logging_rank(stage_group, group=group, rank=log_rank)``: the
    last stage's first rank of ``group``, or global rank ``log_rank``; True when torch.distributed is not
    initialized. Errors name ``who``."""
    if log_rank is not None and (isinstance(log_rank, bool) or not isinstance(log_rank, numbers.Integral)):
        raise TypeError(f"{who}: log_rank must be an int (a global rank) or None, got a {type(log_rank).__name__}")
    if stage_group is None and group is None and log_rank is None:
        return True
    from torch_gradstats.distributed.reduce import is_logging_rank  # only with a group or a rank: torch.distributed

    try:
        return is_logging_rank(stage_group, group=group, rank=None if log_rank is None else int(log_rank))
    except ValueError as exc:
        raise ValueError(f"{who}: {str(exc).replace('is_logging_rank: rank', 'log_rank')}") from None
