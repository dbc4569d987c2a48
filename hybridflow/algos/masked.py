"""The masked reductions under their algorithms-layer name; they are defined in `kernels/masked.py`.

They moved down to the kernels because `masked_whiten` is the reference for
the whitening the GAE kernel fuses, and kernels must not import algos (the
layer order in docs/design.md). This module keeps `hybridflow.algos.masked`
importable; new code imports from `hybridflow.algos` or `hybridflow.kernels.masked`.
"""
from hybridflow.kernels.masked import (as_bool, masked_count, masked_fill_zero, masked_mean, masked_std, masked_sum,
                                       masked_var, masked_whiten)

__all__ = ["as_bool", "masked_count", "masked_fill_zero", "masked_mean", "masked_std", "masked_sum", "masked_var",
           "masked_whiten"]
