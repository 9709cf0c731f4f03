"""Floor 7, entry points: the command line (``main``: ``python -m torch_gradstats info | demo | bench``) and the demo
(``demo``, with its figures in ``_demo_figure`` and its printed output in ``_demo_output``)."""
