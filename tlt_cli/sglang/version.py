"""Which SGLang version serves, and what tlt can do with it.

`installed_sglang_version(python)` asks an interpreter for its installed sglang version without
importing sglang (which needs a GPU stack); a running server reports its own through
`/server_info` (see `weight_sync.server_version`). `sglang_features(version)` turns a version
into the list of things tlt relies on, each found by reading that release's source (0.5.23 in
full; 0.5.10, 0.5.11, 0.5.12, 0.5.13, 0.5.16, 0.5.19, 0.5.20, 0.5.21 and 0.5.22 for the presence of
each feature):

- `--speculative-adaptive`, per-batch-size slots with step 0 (= SD off): since 0.5.16 (absent in
  0.5.12, slots without step 0 in 0.5.13).
- `selector` ("target" / "draft") on update-from-tensor, inside a `/begin_weight_update` ...
  `/end_weight_update` session: since 0.5.21.
- target-only update-from-tensor through `disable_draft_model` (no session): 0.5.10 to 0.5.20 (the
  field is in all; its handling was read in 0.5.20).

Update from disk has no selector in any of them: it reloads every runner from the one path.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass

VERSION_PATTERN = re.compile(r"^(\d+)\.(\d+)\.(\d+)")
ADAPTIVE_SLOTS_SINCE = (0, 5, 16)
WEIGHT_SELECTOR_SINCE = (0, 5, 21)
DISABLE_DRAFT_MODEL_SINCE = (0, 5, 10)


class SGLangVersionError(RuntimeError):
    """SGLang is missing, or too old for what the recipe asks."""


@dataclass(frozen=True)
class SGLangFeatures:
    """What one SGLang release lets tlt do without restarting its servers."""

    version: str
    # --speculative-adaptive with a JSON of batch-size slots, step 0 meaning SD off
    adaptive_slots: bool
    # update-from-tensor takes selector="target"/"draft" inside a begin/end weight-update session
    weight_selector: bool
    # update-from-tensor can leave the draft model alone (disable_draft_model, before selectors)
    target_only_tensor_update: bool

    @property
    def drafter_sync(self) -> bool:
        """Whether the drafter's weights can be pushed into a running server."""
        return self.weight_selector

    def describe(self) -> str:
        """One line saying what this version supports, for the log and the live display."""
        drafter = (
            "drafter weights pushed live"
            if self.drafter_sync
            else "drafter fixed at launch (no draft-weight selector before 0.5.21)"
        )
        table = (
            "rule table through --speculative-adaptive slots"
            if self.adaptive_slots
            else "one fixed SD configuration (no adaptive slots before 0.5.16)"
        )
        return f"SGLang {self.version}: {drafter}; {table}."


def parse_version(version: str) -> tuple[int, int, int]:
    """'0.5.23' or '0.5.15.post1' -> (0, 5, 23) / (0, 5, 15); SGLangVersionError if not a release number."""
    match = VERSION_PATTERN.match(version.strip())
    if match is None:
        raise SGLangVersionError(f"'{version}' is not an SGLang release number like 0.5.23.")
    return int(match.group(1)), int(match.group(2)), int(match.group(3))


def sglang_features(version: str) -> SGLangFeatures:
    """The features of `version`; SGLangVersionError below 0.5.10, the oldest release read."""
    number = parse_version(version)
    if number < DISABLE_DRAFT_MODEL_SINCE:
        raise SGLangVersionError(
            f"SGLang {version} is older than 0.5.10, the oldest release tlt was checked against; "
            "install sglang==0.5.23."
        )
    return SGLangFeatures(
        version=version,
        adaptive_slots=number >= ADAPTIVE_SLOTS_SINCE,
        weight_selector=number >= WEIGHT_SELECTOR_SINCE,
        target_only_tensor_update=number >= DISABLE_DRAFT_MODEL_SINCE,
    )


def installed_sglang_version(python: str) -> str:
    """The sglang version installed for interpreter `python`, read from package metadata only."""
    command = [python, "-c", "import importlib.metadata as m; print(m.version('sglang'))"]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise SGLangVersionError(
            f"Python interpreter '{python}' does not exist; set rollout.sglang.python to one with sglang installed."
        ) from None
    if result.returncode != 0:
        raise SGLangVersionError(
            f"sglang is not installed for '{python}'; run `pip install -e .[sglang]` on the GPU machine "
            "or set rollout.sglang.python."
        )
    return result.stdout.strip()
