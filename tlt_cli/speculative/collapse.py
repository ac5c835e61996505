"""When a moving accept length counts as collapsed or recovered, and which of those the console hears of.

Both SD schedules watch an accept length for collapse: the cost model's per draft source
(tlt_cli/speculative/cost_schedule.py), the rule table's per batch-size bucket (adaptive.py). A figure that
hovers at the threshold must not flap, and a run of hundreds of steps must not fill the console, so:
  - hysteresis: a key collapses when its figure falls under `threshold` and recovers only when it reaches
    `threshold + margin` (RECOVERY_MARGIN tokens per verify pass);
  - one line each: the console hears of a key's first collapse and its first recovery of the run
    (`is_news`); every later transition is only counted, in the trace's sd_config records (ConfigUsage
    `collapses`, `recoveries`), which `tlt profile` reads;
  - a collapse is news only from a key that was healthy (at or above the recovery level) earlier in the run, or
    from the start (the rule table's buckets: a table says SD pays there): a draft source of the cost model (a
    fresh drafter trained online, drafter.init online) starts low and is kept off, silently, until it pays; a
    recovery is news only after a collapse the console heard of.

    watch = CollapseWatch(threshold=1.15)
    change = watch.change("ngram", collapsed=False, accept_length=1.05)   # COLLAPSED
    if change and watch.is_news("ngram", change): warnings.append(...)
"""

from __future__ import annotations

from collections.abc import Iterable

COLLAPSED = "collapsed"
RECOVERED = "recovered"
# SD steps a bucket or draft source must have measured before its accept length can count as collapsed (both
# schedules: rule_schedule.py, cost_schedule.py)
COLLAPSE_MIN_STEPS = 4
# tokens per verify pass above the collapse threshold a collapsed figure must reach to count as recovered
RECOVERY_MARGIN = 0.15


class CollapseWatch:
    """Collapse and recovery with hysteresis, and the (key, change) pairs the console has heard of this run."""

    def __init__(self, threshold: float, margin: float = RECOVERY_MARGIN, healthy: Iterable[str] = ()) -> None:
        """healthy: the keys that count as healthy from the start (the rule table's buckets: a table says SD pays)."""
        self.threshold = threshold
        self.margin = margin
        self.shown: set[tuple[str, str]] = set()
        self.healthy: set[str] = set(healthy)

    def change(self, key: str, collapsed: bool, accept_length: float) -> str | None:
        """COLLAPSED when a key not collapsed falls under the threshold, RECOVERED when a collapsed one reaches the
        threshold plus the margin, else None (the key's state is the caller's); a key at or above that level counts
        as healthy from then on."""
        if accept_length >= self.threshold + self.margin:
            self.healthy.add(key)
        if not collapsed and accept_length < self.threshold:
            return COLLAPSED
        if collapsed and accept_length >= self.threshold + self.margin:
            return RECOVERED
        return None

    def is_news(self, key: str, change: str) -> bool:
        """Whether to show this `change` of `key` on the console: the run's first of its kind, of a key that was
        healthy before (a collapse) or whose collapse was shown (a recovery); remembers the ones shown."""
        news = key in self.healthy if change == COLLAPSED else (key, COLLAPSED) in self.shown
        if not news or (key, change) in self.shown:
            return False
        self.shown.add((key, change))
        return True

    def state_dict(self) -> dict[str, list]:
        return {"shown": sorted([key, change] for key, change in self.shown), "healthy": sorted(self.healthy)}

    def load_state_dict(self, saved: dict[str, list]) -> None:
        self.shown = {(key, change) for key, change in saved["shown"]}
        self.healthy = set(saved["healthy"])
