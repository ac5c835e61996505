"""One worker's rollout through its own SGLang servers (`rollout.backend: sglang`).

Ownership: `rollout.sglang.gpus` split into groups of tp_size gives S servers on each node; with N
worker ranks on the node, the rank of local index r owns servers r*S/N .. (r+1)*S/N - 1 (their
GPUs and their slice of the port range).
It starts them (`start`), generates its shard on them (`generate`), pushes its actor's weights
into them after every update and probes them (`sync`), and stops them (`stop`). Nothing is
shared between workers, so no server is updated twice or by the wrong rank. Server logs go to
`<run_dir>/workers/worker-<r>/sglang/server-<i>.log`; the servers' process groups are recorded
for the driver as soon as they are spawned (tlt_cli/sglang/registry.py), so a worker that dies
cannot orphan them.

A worker is idle once none of its requests is outstanding on any of its servers (the client's
own bookkeeping), which is when `generate` returns; `busy_end` is when the last server went idle.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
from transformers import PreTrainedModel

from tlt_cli.config import Recipe, SGLangConfig
from tlt_cli.processes.hostfile import ranks_per_node
from tlt_cli.rollout.types import Completion, RolloutRequest, SamplingParams
from tlt_cli.sglang.backend import SGLangBackend
from tlt_cli.sglang.config import PORTS_PER_SERVER
from tlt_cli.sglang.registry import record_server_groups
from tlt_cli.sglang.rules import batch_rules
from tlt_cli.sglang.weight_sync import target_tensors, write_checkpoint


@dataclass
class SyncOutcome:
    """One weight sync as the worker reports it."""

    seconds: float
    # mean accept length of the post-sync probes over servers (None when SD did not run in them)
    probe_accept_length: float | None
    warnings: list[str] = field(default_factory=list)


def servers_of_worker(config: SGLangConfig, worker: int, worker_count: int) -> SGLangConfig:
    """The part of `config` worker `worker` owns: its consecutive GPU groups and their ports."""
    per_worker = config.server_count // worker_count
    first = worker * per_worker
    gpus = config.gpus[first * config.tp_size : (first + per_worker) * config.tp_size]
    return dataclasses.replace(config, gpus=gpus, port_base=config.port_base + PORTS_PER_SERVER * first)


def export_drafter_for_sglang(drafter: torch.nn.Module, target: PreTrainedModel, directory: Path) -> Path:
    """Write the drafter as an SGLang EAGLE draft folder (config.json, model.safetensors), as `tlt export-drafter` does."""
    from safetensors.torch import save_file

    from tlt_cli.export import EXPORT_CONFIG_FILE, WEIGHTS_FILE, sglang_config, sglang_tensors

    directory.mkdir(parents=True, exist_ok=True)
    (directory / EXPORT_CONFIG_FILE).write_text(json.dumps(sglang_config(drafter, target), indent=2), encoding="utf-8")
    save_file(sglang_tensors(drafter, target, include_shared=False), str(directory / WEIGHTS_FILE))
    return directory


class SGLangRollout:
    """The SGLang servers of one worker, from start to stop (see the module docstring)."""

    def __init__(self, recipe: Recipe, worker: int, rank_on_node: int, run_directory: Path, model_folder: Path,
                 eos_token_id: int, tie_word_embeddings: bool):
        self.recipe = recipe
        self.worker = worker
        self.run_directory = run_directory
        self.directory = run_directory / "workers" / f"worker-{worker}"
        # rollout.sglang.gpus are the GPUs of each node, shared among the ranks of that node
        config = servers_of_worker(recipe.rollout.sglang, rank_on_node, ranks_per_node(recipe))
        self.backend = SGLangBackend(config, str(model_folder), self.directory, batch_rules(recipe.speculative),
                                     draft_model_path=None, eos_token_id=eos_token_id, seed=recipe.run.seed,
                                     tie_word_embeddings=tie_word_embeddings,
                                     on_servers_spawned=lambda groups: record_server_groups(run_directory, worker, groups))
        self.tie_word_embeddings = tie_word_embeddings
        # the drafter_sidecar's version the servers hold (it starts at 0, the drafter they launch with)
        self.pushed_drafter_version = 0.0
        self.shown_notes: set[str] = set()

    def start(self, drafter: torch.nn.Module | None, target: PreTrainedModel) -> list[str]:
        """Export the starting drafter (if any), start this worker's servers; lines for the worker log."""
        if drafter is not None:
            self.backend.draft_model_path = str(export_drafter_for_sglang(drafter, target, self.directory / "sglang" / "drafter-initial"))
        return self.backend.start()

    def stop(self) -> None:
        self.backend.stop()

    def generate(self, requests: Sequence[RolloutRequest], sampling: SamplingParams, seed: int) -> tuple[list[Completion], float]:
        """(completions in request order, the time the last of this worker's servers went idle)."""
        idle_times: list[float] = []
        completions = self.backend.generate(requests, sampling, on_server_idle=lambda server, when: idle_times.append(when), seed=seed)
        return completions, max(idle_times, default=time.time())

    def sync(self, weight_version: str, policy: PreTrainedModel, drafter: torch.nn.Module | None,
             drafter_version: float | None, probe_prompts: Sequence[Sequence[int]]) -> SyncOutcome:
        """Push the policy (and a drafter the sidecar has moved since the last push), then probe every server."""
        started = time.perf_counter()
        colocated = self.backend.config.colocated
        target_dir = None if colocated else self._write_target_checkpoint(policy)
        new_drafter = drafter is not None and drafter_version is not None and drafter_version != self.pushed_drafter_version
        report = self.backend.sync_weights(
            weight_version, target_parameters=policy.named_parameters() if colocated else None, target_dir=target_dir,
            drafter_state=drafter.state_dict() if new_drafter else None, probe_prompts=probe_prompts,
        )
        if report.drafter_pushed:
            self.pushed_drafter_version = drafter_version
        notes = [note for note in report.notes if note not in self.shown_notes]
        self.shown_notes.update(notes)
        measured = [probe.accept_length for probe in report.probes if probe.verify_passes]
        return SyncOutcome(time.perf_counter() - started, statistics.mean(measured) if measured else None,
                           notes + report.collapsed)

    def _write_target_checkpoint(self, policy: PreTrainedModel) -> Path:
        """The policy as a safetensors folder the servers reload (overwritten at every sync)."""
        tensors = target_tensors(policy.named_parameters(), self.tie_word_embeddings)
        return write_checkpoint(tensors, self.directory / "sglang" / "weights")
