"""``python -m torch_gradstats info | demo | bench``."""

from torch_gradstats.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
