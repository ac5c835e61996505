"""How many tokens a speculative configuration emits per verify pass, learned from the run's own verify passes.

The cost-model schedule (tlt_cli/speculative/cost_schedule.py) asks `expected_tokens(config)` for every candidate
configuration before each decode step and feeds back each verify pass (`observe`: the configuration and the
drafted tokens each row accepted). Two estimates, both decaying so that a drafter trained online, or a policy
that moved, is followed:

  - per draft source (the drafter, the n-gram index), by depth: of the verify passes that offered a chain of at
    least d tokens from that source, the share whose first d drafted tokens were all accepted (`through[d]`). A
    chain of depth k is then expected to emit 1 + through[1] + ... + through[k] tokens (the bonus token plus the
    accepted ones), so measuring s4 also predicts s2 and s6; a depth not offered yet continues the deepest
    measured one's ratio;
  - per configuration label, for shapes that mix sources (hybrid `+`, a per-row choice `|`) or branch (trees):
    a moving average of tokens per pass once measured, until then the better of its sources' chains.
A source never measured starts from a prior: PRIOR_THROUGH[source] at depth 1 and the same ratio per depth,
weighed as PRIOR_PASSES passes (so the first real passes take over quickly). When a source itself changes (the
drafter after a round of training), `forget(source, keep)` scales what was measured of it, and of every label that
drafts from it, by `keep`: the new drafter's first passes then outweigh the old one's hundreds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tlt_cli.speculative.types import DRAFT_SOURCES, DRAFTER_SOURCE, NGRAM_SOURCE, SpeculativeConfig

# prior share of passes accepting the first drafted token, and the ratio of each next depth to the one before
PRIOR_THROUGH = {DRAFTER_SOURCE: 0.5, NGRAM_SOURCE: 0.3}
PRIOR_PASSES = 4.0
# weight of older passes kept per new pass: about the last 1 / (1 - DECAY) passes count
DECAY = 0.998
# a label's own average replaces the sources' prediction after this many (decayed) passes
LABEL_MIN_PASSES = 8.0
LABEL_SMOOTHING = 0.05


@dataclass
class DepthCounts:
    """Decayed counts of one draft source's chains: offered[d - 1] passes offering depth >= d, accepted[d - 1] of
    them accepting all of the first d drafted tokens."""

    offered: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def add(self, depth: int, accepted_tokens: int, weight: float = 1.0) -> None:
        missing = depth - len(self.offered)
        if missing > 0:
            self.offered.extend([0.0] * missing)
            self.accepted.extend([0.0] * missing)
        for index in range(depth):
            self.offered[index] += weight
            if index < accepted_tokens:
                self.accepted[index] += weight

    def decay(self, factor: float) -> None:
        self.offered = [value * factor for value in self.offered]
        self.accepted = [value * factor for value in self.accepted]

    def through(self, depth: int, prior: float) -> list[float]:
        """The share of passes accepting the first d tokens, d = 1..depth, each smoothed towards prior**d."""
        shares: list[float] = []
        for index in range(depth):
            if index < len(self.offered) and self.offered[index] > 0:
                prior_share = prior ** (index + 1)
                smoothed = (self.accepted[index] + PRIOR_PASSES * prior_share) / (self.offered[index] + PRIOR_PASSES)
                shares.append(min(smoothed, shares[-1]) if shares else smoothed)
            else:  # not offered yet: continue the deepest measured ratio (or the prior's)
                ratio = shares[-1] / shares[-2] if len(shares) >= 2 and shares[-2] > 0 else prior
                shares.append((shares[-1] if shares else 1.0) * min(ratio, 1.0))
        return shares


@dataclass
class LabelAverage:
    """A label's decayed passes and its moving average of tokens emitted per verify pass."""

    passes: float = 0.0
    tokens_per_pass: float = 0.0


class AcceptanceEstimates:
    """Tokens per verify pass expected of each configuration (see the module docstring)."""

    def __init__(self, prior_through: dict[str, float] | None = None) -> None:
        self.prior_through = dict(PRIOR_THROUGH | (prior_through or {}))
        self.by_source = {source: DepthCounts() for source in DRAFT_SOURCES}
        self.by_label: dict[str, LabelAverage] = {}
        # label -> the draft sources its configuration drafts from (for `forget`)
        self.label_sources: dict[str, tuple[str, ...]] = {}

    def expected_tokens(self, config: SpeculativeConfig) -> float:
        """Tokens a verify pass of `config` is expected to emit per row: accepted drafts plus the bonus token."""
        if _single_chain_source(config) is None:
            measured = self.by_label.get(config.label())
            if measured is not None and measured.passes >= LABEL_MIN_PASSES:
                return measured.tokens_per_pass
            return max(self.chain_tokens(source, depth) for source, depth in _chains_of(config))
        source, depth = _chains_of(config)[0]
        return self.chain_tokens(source, depth)

    def chain_tokens(self, source: str, depth: int) -> float:
        """1 + the expected accepted tokens of a chain of `depth` tokens from `source`."""
        return 1.0 + sum(self.by_source[source].through(depth, self.prior_through[source]))

    def observe(self, config: SpeculativeConfig, accepted_per_row: tuple[int, ...]) -> None:
        """One verify pass of `config`: the drafted tokens each verified row accepted."""
        if not accepted_per_row:
            return
        rows = len(accepted_per_row)
        factor = DECAY**rows
        for counts in self.by_source.values():
            counts.decay(factor)
        for label_average in self.by_label.values():
            label_average.passes *= factor
        source = _single_chain_source(config)
        if source is not None:
            depth = _chains_of(config)[0][1]
            for accepted in accepted_per_row:
                self.by_source[source].add(depth, accepted)
            return
        average = self.by_label.setdefault(config.label(), LabelAverage())
        self.label_sources[config.label()] = tuple(source for source, _ in _chains_of(config))
        tokens = sum(accepted_per_row) / rows + 1
        weight = 1.0 if average.passes == 0 else LABEL_SMOOTHING
        average.tokens_per_pass += weight * (tokens - average.tokens_per_pass)
        average.passes += rows

    def forget(self, source: str, keep: float) -> None:
        """`source` changed: keep the share `keep` of what was measured of it and of the labels drafting from it."""
        self.by_source[source].decay(keep)
        for label, sources in self.label_sources.items():
            if source in sources:
                self.by_label[label].passes *= keep

    def describe(self) -> dict[str, float]:
        """Per source, the expected tokens per pass of its depth-1 to depth-4 chains (for logs and tests)."""
        return {
            f"{source} depth {depth}": self.chain_tokens(source, depth) for source in DRAFT_SOURCES for depth in (1, 4)
        }

    def state_dict(self) -> dict:
        return {
            "by_source": {source: [counts.offered, counts.accepted] for source, counts in self.by_source.items()},
            "by_label": {label: [value.passes, value.tokens_per_pass] for label, value in self.by_label.items()},
            "label_sources": {label: list(sources) for label, sources in self.label_sources.items()},
        }

    def load_state_dict(self, saved: dict) -> None:
        for source, (offered, accepted) in saved["by_source"].items():
            self.by_source[source] = DepthCounts(list(offered), list(accepted))
        self.by_label = {label: LabelAverage(*values) for label, values in saved["by_label"].items()}
        # checkpoints written before `forget` existed do not name them: every source, to be safe
        self.label_sources = {label: tuple(sources) for label, sources in saved.get("label_sources", {}).items()} | {
            label: DRAFT_SOURCES for label in self.by_label if label not in saved.get("label_sources", {})
        }


def _chains_of(config: SpeculativeConfig) -> list[tuple[str, int]]:
    """The (source, depth) chains `config` drafts: the drafter's to its depth, the n-gram index's up to its tokens."""
    chains = []
    if config.uses_drafter:
        chains.append((DRAFTER_SOURCE, config.steps))
    if config.uses_ngram:
        chains.append((NGRAM_SOURCE, config.ngram_tokens))
    return chains


def _single_chain_source(config: SpeculativeConfig) -> str | None:
    """The one source of a plain chain (the drafter's topk-1 chain, or n-gram alone); None for a tree or a mix."""
    chains = _chains_of(config)
    if len(chains) == 1 and config.is_chain:
        return chains[0][0]
    return None
