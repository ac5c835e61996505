"""What speculative decoding is asked for and what it reports: the shape of a step, the stats of a request.

`SpeculativeConfig` names a speculative-decoding shape the way SGLang does (steps, topk,
draft_tokens), optionally with a branch of model-free n-gram proposals (tlt_cli/speculative/ngram.py);
`SpeculativeStats` is what SD did for one request, `DecodeStep` one timed decode step (what the
adaptive schedule learns from), and `accept_length` the one definition of accept length. The
engine, the adaptive rule table, the SGLang backend, the trace and `tlt profile` all speak these types.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


def accept_length(accepted_draft_tokens: int, verify_passes: int) -> float | None:
    """Tokens emitted per verify pass: the accepted drafts plus each pass's bonus token; None when SD never ran.

    The one definition of accept length: the engine's per-request stats, the step records of the
    trace, `tlt profile`, SGLang's probes and `tlt export-drafter` all report this number.
    """
    return (accepted_draft_tokens + verify_passes) / verify_passes if verify_passes else None


def source_accept_lengths(counts: Mapping[str, float]) -> dict[str, float]:
    """Draft source -> accept length counting only the drafts that source proposed, over the verify
    passes of configurations using it, from counts named `<source>_verify_passes` and
    `<source>_accepted_tokens` (a ConfigUsage's fields, an sd_config trace record); sources with no
    verify pass are left out."""
    lengths = {}
    for source in DRAFT_SOURCES:
        passes = int(counts.get(f"{source}_verify_passes", 0))
        if passes:
            lengths[source] = accept_length(int(counts.get(f"{source}_accepted_tokens", 0)), passes)
    return lengths


# the label of plain decoding (no SD configuration) in rule tables, usage and the trace
OFF = "off"


def label_of(config: SpeculativeConfig | None) -> str:
    return OFF if config is None else config.label()


@dataclass
class ConfigUsage:
    """Time spent in one configuration during a rollout and, per draft source (DRAFT_SOURCES), the
    verify passes that drafted with it and the accepted tokens it had proposed (a token both sources
    proposed counts for both): types.source_accept_lengths reads them."""

    decode_steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    drafter_verify_passes: int = 0
    drafter_accepted_tokens: int = 0
    ngram_verify_passes: int = 0
    ngram_accepted_tokens: int = 0
    # mode auto (tlt_cli/speculative/cost_schedule.py): the cost model's tokens and seconds predicted for these
    # steps before they ran
    predicted_tokens: float = 0.0
    predicted_seconds: float = 0.0
    # the running batch sizes they ran at: batch size -> decode steps, their seconds and the tokens they emitted
    # (tlt_cli/sd_effect.py compares SD with plain decoding at the same batch sizes from these)
    batch_sizes: dict[str, int] = field(default_factory=dict)
    batch_seconds: dict[str, float] = field(default_factory=dict)
    batch_tokens: dict[str, int] = field(default_factory=dict)
    # a draft source (mode auto) or batch-size bucket (the rule table) collapsing or recovering at these steps:
    # the console shows only each one's first of the run (tlt_cli/speculative/collapse.py), the trace counts all
    collapses: int = 0
    recoveries: int = 0
    # mode auto: the times the run's own steps measured these slower than plain decoding at a batch size, which
    # dropped them there for a while (tlt_cli/speculative/plain_check.py; the console shows the run's first)
    plain_drops: int = 0

    def add_step_at(self, batch_size: int, seconds: float, tokens: int) -> None:
        """One decode step of these at `batch_size` running rows: its count, seconds and tokens by batch size."""
        key = str(batch_size)
        self.batch_sizes[key] = self.batch_sizes.get(key, 0) + 1
        self.batch_seconds[key] = self.batch_seconds.get(key, 0.0) + seconds
        self.batch_tokens[key] = self.batch_tokens.get(key, 0) + tokens

    def add_draft_counts(self, passes_by_source: Mapping[str, int], accepted_by_source: Mapping[str, int]) -> None:
        """One verify pass's counts per draft source (draft_counts.py `StepCounts`), added to this configuration's."""
        self.drafter_verify_passes += passes_by_source[DRAFTER_SOURCE]
        self.drafter_accepted_tokens += accepted_by_source[DRAFTER_SOURCE]
        self.ngram_verify_passes += passes_by_source[NGRAM_SOURCE]
        self.ngram_accepted_tokens += accepted_by_source[NGRAM_SOURCE]


class ScheduleReports:
    """What a schedule of SD configurations reports per rollout step, kept in one place for the rule table's and
    the cost model's: time and counts per configuration label (`usage`) and warnings, each taken once."""

    def __init__(self) -> None:
        self.usage: dict[str, ConfigUsage] = defaultdict(ConfigUsage)
        self.warnings: list[str] = []

    def take_usage(self) -> dict[str, ConfigUsage]:
        usage, self.usage = dict(self.usage), defaultdict(ConfigUsage)
        return usage

    def take_warnings(self) -> list[str]:
        warnings, self.warnings = self.warnings, []
        return warnings


# the largest SD shape a drafter drafts: depth (and n-gram tokens), branches per position, tokens a verify pass checks
# (speculative/shapes.py refuses a larger one: a draft deeper than any response only hangs the decoder building it)
MAX_DRAFT_STEPS = 64
MAX_DRAFT_TOPK = 64
MAX_VERIFIED_TOKENS = 1024

# where a drafted token came from: the trained drafter, or the model-free n-gram index
DRAFTER_SOURCE, NGRAM_SOURCE = "drafter", "ngram"
DRAFT_SOURCES = (DRAFTER_SOURCE, NGRAM_SOURCE)


def draft_sources(configs: Iterable[SpeculativeConfig | None]) -> frozenset[str]:
    """The DRAFT_SOURCES any of `configs` drafts from (None, plain decoding, drafts from none)."""
    configs = [config for config in configs if config is not None]
    uses = {
        DRAFTER_SOURCE: any(config.uses_drafter for config in configs),
        NGRAM_SOURCE: any(config.uses_ngram for config in configs),
    }
    return frozenset(source for source in DRAFT_SOURCES if uses[source])


@dataclass(frozen=True)
class SpeculativeConfig:
    """One speculative-decoding shape.

    steps: draft depth of the drafter (tokens drafted along each branch; 0: no drafter pass);
    topk: branches kept per drafted position (1 is a chain); draft_tokens: tokens the drafter's
    part verifies in one target pass (for a chain, steps + 1 including the root); ngram_tokens:
    up to this many tokens proposed by the n-gram index over the prompt and the sibling responses
    of the request's group, as one more branch of the verified tree (0: none).

    Labels: `s4-k1-t5` (drafter only), `ngram4` (model-free: steps 0, no drafter pass at all),
    `s2-k1-t3+ngram4` (hybrid: the drafter's chain or tree and the n-gram branch in one pass),
    `s2-k1-t3|ngram4` (picks_source: each row verifies one chain, the drafter's or the n-gram
    index's, whichever has accepted more for that row lately).
    """

    steps: int
    topk: int = 1
    draft_tokens: int = 0
    ngram_tokens: int = 0
    picks_source: bool = False

    @property
    def is_chain(self) -> bool:
        return self.topk == 1

    @property
    def uses_drafter(self) -> bool:
        return self.steps > 0

    @property
    def uses_ngram(self) -> bool:
        return self.ngram_tokens > 0

    @property
    def drafter_part(self) -> SpeculativeConfig:
        """The drafter's shape alone (no n-gram branch)."""
        return SpeculativeConfig(self.steps, self.topk, self.draft_tokens)

    @property
    def model_free_part(self) -> SpeculativeConfig | None:
        """The n-gram branch alone (model-free: no drafter pass), or None when the shape drafts no n-grams."""
        return SpeculativeConfig(0, ngram_tokens=self.ngram_tokens) if self.uses_ngram else None

    def label(self) -> str:
        ngram = f"ngram{self.ngram_tokens}"
        if not self.uses_drafter:
            return ngram
        drafter = f"s{self.steps}-k{self.topk}-t{self.verified_tokens}"
        if not self.uses_ngram:
            return drafter
        return f"{drafter}{'|' if self.picks_source else '+'}{ngram}"

    @property
    def verified_tokens(self) -> int:
        """Tokens the drafter's part verifies per pass, root included (the n-gram branch adds up to ngram_tokens)."""
        return self.draft_tokens if self.draft_tokens > 0 else self.steps + 1


@dataclass(frozen=True)
class DecodeStep:
    """One decode step of a generate call, as `on_decode_step` sees it.

    batch_size: rows running when the step began; tokens: response tokens it added (cut at EOS
    and max_new_tokens, as the completions hold them); seconds: from its start to the end of its
    bookkeeping (finished rows retired), so consecutive steps tile the decode loop.
    """

    batch_size: int
    tokens: int
    seconds: float


@dataclass
class SpeculativeStats:
    """What speculative decoding did for one request (all zero when SD was off)."""

    verify_passes: int = 0
    # tokens accepted from drafts (not counting the bonus token of each verify pass)
    accepted_draft_tokens: int = 0
    # accepted_by_depth[d] = drafts whose token at depth d (0-based) was accepted
    accepted_by_depth: list[int] = field(default_factory=list)
    proposed_by_depth: list[int] = field(default_factory=list)
    # draft source (DRAFT_SOURCES) -> verify passes of configurations using it, and accepted tokens
    # it had proposed (a token both sources proposed counts for both)
    passes_by_source: dict[str, int] = field(default_factory=dict)
    accepted_by_source: dict[str, int] = field(default_factory=dict)

    @property
    def accept_length(self) -> float | None:
        """Tokens emitted per verify pass (accepted drafts + the bonus token); None without SD."""
        return accept_length(self.accepted_draft_tokens, self.verify_passes)
