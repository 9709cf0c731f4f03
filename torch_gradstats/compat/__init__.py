"""Drop-in replacements for the gradient-norm functions large training frameworks call.

* :mod:`torch_gradstats.compat.torchtitan`: ``clip_grad_norm_`` with torchtitan's signature and return value
  (pipeline mesh, expert-parallel switch, DTensor gradients), one fused read and no host sync.
* :mod:`torch_gradstats.compat.megatron`: ``get_grad_norm_fp32`` and ``count_zeros_fp32`` with Megatron-LM's
  signatures and return types; the two share one read (and one reduction) when called on the same gradients.
* :mod:`torch_gradstats.compat.deepspeed`: whole-parameter statistics from DeepSpeed ZeRO stage 1/2 gradient
  partitions, by the layout's arithmetic.

None of them imports torchtitan, Megatron or DeepSpeed: they reproduce the functions' contracts on plain PyTorch
(``torch.distributed`` and DTensor). See docs/compat.md.
"""

from __future__ import annotations

__all__ = ["deepspeed", "megatron", "torchtitan"]
