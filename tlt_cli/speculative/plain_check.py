"""Mode auto's check against plain decoding by the run's own figures: a configuration that decodes slower than plain
at a batch size stops speculating there, and is tried again after a growing interval.

The cost model (cost_schedule.py) predicts each configuration's rate from measured passes; this check holds it to
what the run's own decode steps say. `CostSchedule` hands it every timed step (`observe`) and asks it before each
choice which configurations it may pick at the running batch size (`allows`):

    check = PlainCheck(reprobe_steps=64)
    check.observe("ngram4", rows=2, seconds=0.031, tokens=3, step=120)   # a step of a configuration, or "off"
    check.allows("ngram4", rows=2, step=121)                             # False while dropped there

Each JUDGED_STEPS steps of a configuration at one batch size are set against plain decoding of the same tokens at
that size, priced as the run summary prices them (tlt_cli/sd_effect.py `plain_seconds_for` over the run's plain
steps so far, pooled by batch size). Where they took longer, the configuration is dropped at that size for an
interval, then allowed again (the cost model chooses it or not). The interval is `reprobe_steps` decode steps at a
batch size's first loss and doubles with each further loss of any configuration there (so a dozen candidates do
not each re-probe at the first interval), up to MOST_INTERVAL_FACTOR times `reprobe_steps`; a win there resets it.
Without a plain step in the run yet there is nothing to compare with, and nothing is dropped. The first drop of
the run is one console line (`observe` returns it); the drops are counted (`drops`) for the trace.
"""

from __future__ import annotations

from dataclasses import dataclass

from tlt_cli.sd_effect import PLAIN_LABEL, RowsTiming, plain_seconds_for, plain_step_seconds

# steps of a configuration at one batch size that make one judgement of it there
JUDGED_STEPS = 4
# the longest interval between tries of a dropped configuration, in multiples of the first
MOST_INTERVAL_FACTOR = 16


@dataclass
class _Tally:
    """Decode steps, seconds and tokens of one configuration at one batch size since it was last judged."""

    decode_steps: int = 0
    seconds: float = 0.0
    tokens: int = 0


class PlainCheck:
    """Drops a configuration where the run measured it slower than plain decoding (module docstring)."""

    def __init__(self, reprobe_steps: int) -> None:
        self.reprobe_steps = reprobe_steps
        # batch size -> the run's plain steps there (pooled: plain_step_seconds reads them as RowsTiming)
        self.plain: dict[int, _Tally] = {}
        # (label, batch size) -> steps since its last judgement
        self.pending: dict[tuple[str, int], _Tally] = {}
        # (label, batch size) -> (the decode step it may run again from, the interval that set it)
        self.dropped: dict[tuple[str, int], tuple[int, int]] = {}
        # batch size -> losses of configurations there since SD last paid there
        self.losses: dict[int, int] = {}
        self.drops = 0

    def allows(self, label: str, rows: int, step: int) -> bool:
        """Whether `label` may decode at `rows` rows at decode step `step`."""
        dropped = self.dropped.get((label, rows))
        return dropped is None or step >= dropped[0]

    def observe(self, label: str, rows: int, seconds: float, tokens: int, step: int) -> str | None:
        """Fold a timed decode step in; the console line of the run's first drop, else None."""
        tally = (
            self.plain.setdefault(rows, _Tally())
            if label == PLAIN_LABEL
            else self.pending.setdefault((label, rows), _Tally())
        )
        tally.decode_steps += 1
        tally.seconds += seconds
        tally.tokens += tokens
        if label == PLAIN_LABEL or tally.decode_steps < JUDGED_STEPS:
            return None
        return self._judge(label, rows, self.pending.pop((label, rows)), step)

    def _judge(self, label: str, rows: int, tally: _Tally, step: int) -> str | None:
        """Set `tally`'s steps against plain decoding of their tokens at `rows` rows: drop or keep `label` there."""
        plain = plain_step_seconds(
            RowsTiming(PLAIN_LABEL, 0, size, value.decode_steps, value.seconds, value.tokens)
            for size, value in self.plain.items()
        )
        if plain is None:
            return None
        timing = RowsTiming(label, 0, rows, tally.decode_steps, tally.seconds, tally.tokens)
        plain_seconds = plain_seconds_for(timing, plain)
        if tally.seconds <= plain_seconds:
            self.dropped.pop((label, rows), None)
            self.losses.pop(rows, None)
            return None
        losses = self.losses[rows] = self.losses.get(rows, 0) + 1
        interval = self.reprobe_steps * min(2 ** (losses - 1), MOST_INTERVAL_FACTOR)
        self.dropped[label, rows] = (step + interval, interval)
        self.drops += 1
        if self.drops > 1:
            return None
        return (
            f"SD ({label}) decoded {tally.seconds / plain_seconds:.2f}x slower than plain decoding at {rows} running "
            f"row{'s' if rows != 1 else ''} by "
            f"this run's own steps: mode auto stops speculating with it there, tried again after {interval} decode "
            "steps, the interval doubling with each loss there (later drops go to the trace only)"
        )

    def state_dict(self) -> dict:
        return {
            "plain": {
                str(rows): [value.decode_steps, value.seconds, value.tokens] for rows, value in self.plain.items()
            },
            "dropped": [[label, rows, until, interval] for (label, rows), (until, interval) in self.dropped.items()],
            "losses": {str(rows): count for rows, count in self.losses.items()},
            "drops": self.drops,
        }

    def load_state_dict(self, saved: dict) -> None:
        self.plain = {
            int(rows): _Tally(int(steps), float(seconds), int(tokens))
            for rows, (steps, seconds, tokens) in saved.get("plain", {}).items()
        }
        self.dropped = {
            (label, int(rows)): (int(until), int(interval)) for label, rows, until, interval in saved.get("dropped", [])
        }
        self.losses = {int(rows): int(count) for rows, count in saved.get("losses", {}).items()}
        self.drops = int(saved.get("drops", 0))
        self.pending = {}
