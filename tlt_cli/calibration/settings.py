"""What `tlt calibrate` is asked to measure: the options, parsed and checked (no torch, so the CLI loads fast)."""

from __future__ import annotations

from dataclasses import dataclass

from tlt_cli.errors import UserError

# off, three chains and two trees: a small set that spans shallow to deep drafts
DEFAULT_CONFIGS = ("off", "s2-k1-t3", "s3-k1-t4", "s4-k1-t5", "s8-k1-t9", "s4-k2-t8", "s6-k4-t16")


class CalibrationError(UserError):
    """A calibration that cannot run as asked; the message names the option or recipe key to fix."""


@dataclass(frozen=True)
class CalibrationSettings:
    """What to measure and how to choose. batch_sizes: empty for the default grid."""

    batch_sizes: tuple[int, ...] = ()
    configs: tuple[str, ...] = DEFAULT_CONFIGS
    # worker shards each configuration generates
    repeats: int = 6
    # SD must beat off by more than this fraction; runners-up within it become bandit candidates
    margin: float = 0.05
    candidates: int = 2


def check_settings(settings: CalibrationSettings) -> None:
    """Raise CalibrationError naming the option that is out of range."""
    if settings.repeats < 1:
        raise CalibrationError(f"--repeats is {settings.repeats}; set it to at least 1.")
    if not 0.0 <= settings.margin < 1.0:
        raise CalibrationError(f"--margin is {settings.margin}; give a fraction in [0, 1), e.g. 0.05 for 5%.")
    if settings.candidates < 0:
        raise CalibrationError(f"--candidates is {settings.candidates}; give 0 or more.")


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    """'1,2,4' -> (1, 2, 4); '' -> () (the default grid)."""
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise CalibrationError(
            f"--batch-sizes '{text}' is not a comma-separated list of whole numbers, e.g. 1,2,4,8."
        ) from None
