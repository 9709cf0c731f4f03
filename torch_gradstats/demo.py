"""``torch_gradstats.demo``, the documented path of :mod:`torch_gradstats.cli.demo` (the demo behind
``python -m torch_gradstats demo``).
"""

from torch_gradstats.cli.demo import (
    DemoResult,
    build_parser,
    main,
    make_data,
    make_model,
    run,
)

__all__ = [
    "DemoResult",
    "build_parser",
    "main",
    "make_data",
    "make_model",
    "run",
]
