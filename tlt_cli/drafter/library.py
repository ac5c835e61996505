"""The drafters tlt holds per base model on this machine: written by every run and warm-up, read by the next run.

A drafter is an asset of the base model, not of the run (docs/design.md): it drafts for any task on that model.
So the library keys a drafter by the model's own files (its config, weights and tokenizer: `library_key`), never
by the task or the recipe, and holds the newest one per model:

    <cache>/drafters/model-<key>/current -> v-<time>-<pid>/   drafter.safetensors, drafter_config.json
                                                             (save_drafter's layout) and record.json

`record.json` says where the drafter came from and how well it drafted when it was written (`DrafterRecord`).
`publish` writes a new version beside the old and moves the `current` link onto it in one rename, so a reader
sees the old drafter or the new one, never half of either; `newest` reads the linked version back, and counts a
damaged one as absent, with a warning. The composition root (training/setup.py `prepare_drafter`) resolves
`drafter.init: auto` here; the driver publishes a run's drafter at its end (processes/drafter_publish.py), the
warm-up its result, and `tlt export-policy` the run's drafter under the exported policy's key.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tlt_cli.drafter.model import DrafterLoadError, read_drafter_metadata

LOGGER = logging.getLogger(__name__)

LIBRARY_FOLDER = "drafters"
CURRENT_LINK = "current"
RECORD_FILE = "record.json"
# the tokenizer's files, beside the config and weights in what keys a drafter (a new tokenizer maps other ids)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.model")
# versions kept per model: the linked one and the one before (a concurrent publisher may still be linking it)
VERSIONS_KEPT = 2


@dataclass(frozen=True)
class DrafterRecord:
    """What is known of a library drafter: source ("run NAME, step S" or "warm-up"), model (the path it was
    trained for), accept_length (tokens per verify pass it reached in its last measured rollout, None when none
    was measured), acceptance (held-out chance a sampled draft token is accepted, None when not measured) and
    temperature (the sampling temperature those were measured at), written (seconds since the epoch)."""

    source: str
    model: str
    accept_length: float | None = None
    acceptance: float | None = None
    temperature: float | None = None
    written: float = 0.0

    def describe(self) -> str:
        """One phrase for the console: where it came from and how well it drafted."""
        measured = []
        if self.accept_length is not None:
            measured.append(f"accept length {self.accept_length:.2f}")
        if self.acceptance is not None:
            measured.append(f"held-out acceptance {self.acceptance:.1%}")
        at = f" at T={self.temperature:g}" if measured and self.temperature is not None else ""
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.written))
        return f"from {self.source} ({when}), " + (", ".join(measured) + at if measured else "not yet measured")


def library_key(model_folder: Path) -> str:
    """A short hash of the model's config, weight and tokenizer files (name, size, modification time, and the
    config's text): a drafter serves exactly the model these describe, whatever the task."""
    from tlt_cli.models.loading import WEIGHT_SUFFIXES

    files = sorted(
        path
        for path in model_folder.iterdir()
        if path.is_file() and (path.suffix in WEIGHT_SUFFIXES or path.name in TOKENIZER_FILES)
    )
    description = {
        "config": (model_folder / "config.json").read_text(encoding="utf-8"),
        "files": [(path.name, path.stat().st_size, path.stat().st_mtime_ns) for path in files],
    }
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:16]


def model_entry(cache: Path, model_folder: Path) -> Path:
    """The library's folder for the model in `model_folder` under the model cache `cache`."""
    return cache / LIBRARY_FOLDER / f"model-{library_key(model_folder)}"


def newest(cache: Path, model_folder: Path) -> tuple[Path, DrafterRecord] | None:
    """(folder, record) of the newest drafter held for the model, or None (none held, or the held one damaged:
    a warning, and the next publish replaces it)."""
    link = model_entry(cache, model_folder) / CURRENT_LINK
    if not link.is_symlink() and not link.exists():
        return None
    folder = link.resolve()
    try:
        read_drafter_metadata(folder)
    except DrafterLoadError as error:
        LOGGER.warning("the drafter held for this model in %s is damaged (%s); starting without it.", folder, error)
        return None
    record = record_of(folder)
    if record is None:
        LOGGER.warning(
            "the drafter held for this model in %s has no readable %s; starting without it.", folder, RECORD_FILE
        )
        return None
    return folder, record


def record_of(folder: Path) -> DrafterRecord | None:
    """The record beside a library drafter in `folder` (None: not a library version, or unreadable)."""
    try:
        return DrafterRecord(**json.loads((folder / RECORD_FILE).read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        return None


def publish(cache: Path, model_folder: Path, drafter_folder: Path, record: DrafterRecord) -> Path:
    """Make the drafter saved in `drafter_folder` (save_drafter's layout) the newest one held for the model,
    with `record`; returns the version folder. The old one stays readable until the link moves."""
    entry = model_entry(cache, model_folder)
    entry.mkdir(parents=True, exist_ok=True)
    version = entry / f"v-{time.time_ns()}-{os.getpid()}"
    staging = entry / f".{version.name}.tmp"
    shutil.copytree(drafter_folder, staging, ignore=shutil.ignore_patterns(".*"))
    read_drafter_metadata(staging)  # only a whole drafter is published
    stamped = DrafterRecord(**{**asdict(record), "written": record.written or time.time()})
    (staging / RECORD_FILE).write_text(json.dumps(asdict(stamped), indent=2) + "\n", encoding="utf-8")
    os.replace(staging, version)
    temporary_link = entry / f".{CURRENT_LINK}.tmp-{os.getpid()}"
    temporary_link.unlink(missing_ok=True)
    temporary_link.symlink_to(version.name)
    os.replace(temporary_link, entry / CURRENT_LINK)
    _remove_old_versions(entry)
    return version


def _remove_old_versions(entry: Path) -> None:
    """Remove all but the VERSIONS_KEPT newest versions (never the linked one), and staging folders that a
    killed publisher left more than an hour ago."""
    linked = (entry / CURRENT_LINK).resolve()
    versions = sorted(entry.glob("v-*"), key=lambda path: int(path.name.split("-")[1]), reverse=True)
    for version in versions[VERSIONS_KEPT:]:
        if version.resolve() != linked:
            shutil.rmtree(version, ignore_errors=True)
    for staging in entry.glob(".v-*.tmp"):
        if time.time() - staging.stat().st_mtime > 3600:
            shutil.rmtree(staging, ignore_errors=True)
