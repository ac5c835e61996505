"""When a moving accept length counts as collapsed or recovered, and which of those the console hears of.

Both SD schedules watch an accept length for collapse: the cost model's per draft source
(tlt_cli/speculative/cost_schedule.py), the rule table's per batch-size bucket (adaptive.py). A figure that
hovers at the threshold must not flap, and a run of hundreds of steps must not fill the console, so:
  - hysteresis: a key collapses when its figure falls under `threshold` and recovers only when it reaches
    `threshold + margin` (RECOVERY_MARGIN tokens per verify pass);
  - one line each: the console hears of a key's first collapse and its first recovery of the run
    (`is_first`); every later transition is only counted, in the trace's sd_config records (ConfigUsage
    `collapses`, `recoveries`), which `tlt profile` reads.

    watch = CollapseWatch(threshold=1.15)
    change = watch.change("ngram", collapsed=False, accept_length=1.05)   # COLLAPSED
    if change and watch.is_first("ngram", change): warnings.append(...)
"""

from __future__ import annotations

COLLAPSED = "collapsed"
RECOVERED = "recovered"
# tokens per verify pass above the collapse threshold a collapsed figure must reach to count as recovered
RECOVERY_MARGIN = 0.15


class CollapseWatch:
    """Collapse and recovery with hysteresis, and the (key, change) pairs the console has heard of this run."""

    def __init__(self, threshold: float, margin: float = RECOVERY_MARGIN) -> None:
        self.threshold = threshold
        self.margin = margin
        self.shown: set[tuple[str, str]] = set()

    def change(self, key: str, collapsed: bool, accept_length: float) -> str | None:
        """COLLAPSED when a key not collapsed falls under the threshold, RECOVERED when a collapsed one reaches the
        threshold plus the margin, else None (the key's state is the caller's)."""
        if not collapsed and accept_length < self.threshold:
            return COLLAPSED
        if collapsed and accept_length >= self.threshold + self.margin:
            return RECOVERED
        return None

    def is_first(self, key: str, change: str) -> bool:
        """Whether this is the run's first `change` of `key` (to show on the console); remembers it."""
        first = (key, change) not in self.shown
        self.shown.add((key, change))
        return first

    def state_dict(self) -> list[list[str]]:
        return sorted([key, change] for key, change in self.shown)

    def load_state_dict(self, saved: list[list[str]]) -> None:
        self.shown = {(key, change) for key, change in saved}
