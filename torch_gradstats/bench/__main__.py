"""``python -m torch_gradstats.bench`` (the same as ``python -m torch_gradstats bench``)."""

import sys

from .main import main

sys.exit(main())
