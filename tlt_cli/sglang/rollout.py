"""One worker's rollout through its own SGLang servers (`rollout.backend: sglang`).

`SGLangRollout` is the SGLang implementation of tlt_cli/rollout/backend.py's RolloutBackend; it takes
explicit arguments (tlt_cli/training/setup.py reads them from the recipe).
Ownership: `rollout.sglang.gpus` split into groups of tp_size gives S servers on each node; with N
worker ranks on the node, the rank of local index r owns servers r*S/N .. (r+1)*S/N - 1 (their
GPUs and their slice of the port range).
It starts them (`start`), generates its shard on them (`generate`), pushes its actor's weights
into them after every update and probes them (`after_update`), and stops them (`stop`). Nothing is
shared between workers, so no server is updated twice or by the wrong rank. Server logs go to
`<run_dir>/workers/worker-<r>/sglang/server-<i>.log`; the servers' process groups are recorded
for the driver as soon as they are spawned (tlt_cli/sglang/registry.py), so a worker that dies
cannot orphan them.

A worker is idle once none of its requests is outstanding on any of its servers (the client's
own bookkeeping), which is when `generate` returns; `busy_end` is when the last server went idle.
The servers answer on client threads, so `on_request_finished` runs once the shard is back, in
the order the requests finished. The adaptive schedule runs inside SGLang (no usage or state
here); weight-sync notes and collapses come back through `take_warnings`.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from torch import nn

from tlt_cli.config import SGLangConfig
from tlt_cli.engine.sampling import SamplingParams
from tlt_cli.rollout.types import Completion, RolloutRequest
from tlt_cli.sglang.adaptive import BatchRule
from tlt_cli.sglang.backend import SGLangBackend
from tlt_cli.sglang.config import PORTS_PER_SERVER
from tlt_cli.sglang.drafter_format import write_drafter_folder
from tlt_cli.sglang.registry import record_server_groups
from tlt_cli.sglang.weight_sync import target_tensors, write_checkpoint
from tlt_cli.speculative.types import ConfigUsage


def servers_of_worker(config: SGLangConfig, worker: int, worker_count: int) -> SGLangConfig:
    """The part of `config` worker `worker` owns: its consecutive GPU groups and their ports."""
    per_worker = config.server_count // worker_count
    first = worker * per_worker
    gpus = config.gpus[first * config.tp_size : (first + per_worker) * config.tp_size]
    return dataclasses.replace(config, gpus=gpus, port_base=config.port_base + PORTS_PER_SERVER * first)


class SGLangRollout:
    """The SGLang servers of one worker, from start to stop (see the module docstring)."""

    def __init__(
        self,
        policy: nn.Module,
        drafter: nn.Module | None,
        servers: SGLangConfig,
        model_path: str,
        rules: Sequence[BatchRule],
        eos_token_id: int,
        seed: int,
        run_directory: Path,
        worker: int,
    ):
        """servers: the part of rollout.sglang this worker owns (`servers_of_worker`); model_path: the target's
        Hugging Face folder; rules: the batch-size rules the servers follow (tlt_cli/sglang/adaptive.py)."""
        self.policy, self.drafter = policy, drafter
        self.served_dtype = str(servers.dtype)
        self.directory = run_directory / "workers" / f"worker-{worker}"
        self.tie_word_embeddings = bool(policy.config.tie_word_embeddings)
        self.backend = SGLangBackend(
            servers,
            model_path,
            self.directory,
            rules,
            eos_token_id=eos_token_id,
            seed=seed,
            tie_word_embeddings=self.tie_word_embeddings,
            on_servers_spawned=lambda groups: record_server_groups(run_directory, worker, groups),
        )
        # the drafter version the servers hold (StepContext.drafter_version; 0 is the drafter they launch with)
        self.pushed_drafter_version = 0.0
        self.shown_notes: set[str] = set()
        self.warnings: list[str] = []

    def start(self) -> list[str]:
        """Export the starting drafter (if any), start this worker's servers; lines for the worker log."""
        draft_model_path = None
        if self.drafter is not None:
            folder = self.directory / "sglang" / "drafter-initial"
            draft_model_path = str(write_drafter_folder(self.drafter, self.policy, folder))
        return self.backend.start(draft_model_path)

    def stop(self) -> None:
        self.backend.stop()

    def generate(
        self,
        requests: Sequence[RolloutRequest],
        sampling: SamplingParams,
        seed: int,
        on_request_finished: Callable[[Completion], None] | None = None,
    ) -> tuple[list[Completion], float]:
        """(completions sorted by request id, the time the last of this worker's servers went idle)."""
        idle_times: list[float] = []
        # SGLang seeds request r with seed + r; kept within a 32-bit signed range
        completions = self.backend.generate(
            requests, sampling, on_server_idle=lambda server, when: idle_times.append(when), seed=seed % 2**31
        )
        if on_request_finished is not None:
            for completion in sorted(completions, key=lambda completion: completion.end):
                on_request_finished(completion)
        return sorted(completions, key=lambda completion: completion.request_id), max(idle_times, default=time.time())

    def after_update(
        self, weight_version: str, drafter_version: float | None, probe_prompts: Sequence[Sequence[int]]
    ) -> dict[str, float]:
        """Push the policy (and a drafter the sidecar has moved since the last push), then probe every server.

        Metrics: weight_sync_seconds, and probe_accept_length (mean over the servers whose probe ran SD).
        """
        started = time.perf_counter()
        colocated = self.backend.config.colocated
        target_dir = None if colocated else self._write_target_checkpoint()
        new_drafter = self.drafter is not None and drafter_version not in (None, self.pushed_drafter_version)
        report = self.backend.sync_weights(
            weight_version,
            target_parameters=self.policy.named_parameters() if colocated else None,
            target_dir=target_dir,
            drafter_state=self.drafter.state_dict() if new_drafter else None,
            probe_prompts=probe_prompts,
        )
        if report.drafter_pushed:
            self.pushed_drafter_version = drafter_version
        notes = [note for note in report.notes if note not in self.shown_notes]
        self.shown_notes.update(notes)
        self.warnings.extend(notes + report.collapsed)
        metrics = {"weight_sync_seconds": time.perf_counter() - started}
        measured = [probe.accept_length for probe in report.probes if probe.verify_passes]
        if measured:
            metrics["probe_accept_length"] = statistics.mean(measured)
        return metrics

    def take_usage(self) -> dict[str, ConfigUsage]:
        """Nothing: the servers choose their SD configuration themselves."""
        return {}

    def take_warnings(self) -> list[str]:
        warnings, self.warnings = self.warnings, []
        return warnings

    def drafter_diverged(self) -> bool:
        """Never seen here: the servers draft and verify themselves, and report no drafter that diverged."""
        return False

    def drafter_replaced(self, turned_off: bool) -> None:
        """Nothing to do (drafter_diverged is never true): a drafter the sidecar moves is pushed by after_update."""

    def save_state(self, path: Path) -> None:
        """Nothing to save: the servers' adaptive state starts afresh with them."""

    def load_state(self, path: Path) -> None:
        """Nothing to restore (see save_state)."""

    def _write_target_checkpoint(self) -> Path:
        """The policy as a safetensors folder the servers reload (overwritten at every sync)."""
        tensors = target_tensors(self.policy.named_parameters(), self.tie_word_embeddings)
        return write_checkpoint(tensors, self.directory / "sglang" / "weights")
