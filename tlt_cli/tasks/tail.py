"""A heavy-tailed count per problem index, spread evenly over any run of indices.

Tasks whose work grows with a count (arithmetic's terms, word_arithmetic's events) draw it from
P(n) ~ n^-exponent on low..high: most problems are short and a few run long, the long tail of
response lengths that RL on reasoning has. The draw is stratified rather than independent: index
i takes the quantile u_i = frac(offset + i * golden_ratio) of the distribution (a low-discrepancy
sequence, offset seeded), so any run of consecutive indices, such as one RL step's prompts,
covers the tail evenly and step-to-step reward reflects the policy, not the luck of the mix.
Exponent 0 is the uniform distribution on low..high.
"""

from __future__ import annotations

import numpy as np

# stride of the low-discrepancy sequence that stratifies counts across indices
GOLDEN_RATIO_CONJUGATE = 0.6180339887498949


class StratifiedPowerLaw:
    """Counts in low..high with P(n) ~ n^-exponent, one per index, stratified across indices.

    Example:
        counts = StratifiedPowerLaw(low=1, high=48, exponent=1.5, seed=0)
        [counts.count(index) for index in range(8)]  # mostly 1-3, now and then dozens
    """

    def __init__(self, low: int, high: int, exponent: float, seed: int) -> None:
        self.low = low
        weights = np.arange(low, high + 1, dtype=np.float64) ** -exponent
        self._cdf = np.cumsum(weights / weights.sum())
        self._offset = float(np.random.default_rng([seed]).random())

    def count(self, index: int) -> int:
        """The count of problem `index`: the distribution's quantile frac(offset + index * golden_ratio)."""
        quantile = (self._offset + index * GOLDEN_RATIO_CONJUGATE) % 1.0
        return self.low + min(int(np.searchsorted(self._cdf, quantile, side="right")), len(self._cdf) - 1)
