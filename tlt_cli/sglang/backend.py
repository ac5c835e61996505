"""`SGLangBackend`: one group of SGLang servers, from version detection to stop.

It ties the pieces of this package together in the order a run needs them: read the installed
SGLang version and its features, map the rule table onto them, start the servers, generate
rollouts, push weights after each actor update and check acceptance after each push, stop. A
worker holds it through tlt_cli/sglang/rollout.py's SGLangRollout (its rollout backend).

Example:
    backend = SGLangBackend(recipe.rollout.sglang, model_path, run_dir, rules, eos_token_id=2)
    try:
        backend.start(drafter_dir)
        completions = backend.generate(requests, params, on_server_idle=notify)
        report = backend.sync_weights("step-1", target_parameters=policy.named_parameters(),
                                      drafter_state=drafter.state_dict(), probe_prompts=prompts[:4])
    finally:
        backend.stop()
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tlt_cli.engine.sampling import SamplingParams
from tlt_cli.rollout.types import Completion, RolloutRequest
from tlt_cli.sglang.adaptive import BatchRule, PlanMode, SGLangSpeculativePlan, plan_for_sglang
from tlt_cli.sglang.client import SGLangClient
from tlt_cli.sglang.config import SGLangConfig
from tlt_cli.sglang.server import ServerGroup, launch_sglang_servers
from tlt_cli.sglang.version import SGLangFeatures, installed_sglang_version, sglang_features
from tlt_cli.sglang.weight_sync import (
    AcceptLengthCollapsed,
    ProbeResult,
    WeightSyncError,
    check_sync_landed,
    drafter_tensors,
    probe_accept_length,
    push_target_from_disk,
    push_tensors,
    target_tensors,
)


@dataclass
class SyncReport:
    """What one weight sync did: probe results per server and whether the drafter moved."""

    weight_version: str
    drafter_pushed: bool
    probes: list[ProbeResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # one message per server whose accept length collapsed across this sync
    collapsed: list[str] = field(default_factory=list)


class SGLangBackend:
    """Rollout servers for one run; `start(draft_model_path)` then `stop()`."""

    def __init__(
        self,
        config: SGLangConfig,
        model_path: str,
        run_dir: str | Path,
        rules: Sequence[BatchRule],
        eos_token_id: int,
        seed: int = 0,
        tie_word_embeddings: bool = False,
        on_servers_spawned: Callable[[list[int]], None] | None = None,
    ):
        self.config = config
        self.model_path = model_path
        self.run_dir = Path(run_dir)
        self.rules = list(rules)
        self.eos_token_id = eos_token_id
        self.seed = seed
        self.tie_word_embeddings = tie_word_embeddings
        self.on_servers_spawned = on_servers_spawned
        self.features: SGLangFeatures | None = None
        self.plan: SGLangSpeculativePlan | None = None
        self.group: ServerGroup | None = None
        self.client: SGLangClient | None = None
        self._last_probes: list[ProbeResult | None] = []

    def start(self, draft_model_path: str | None) -> list[str]:
        """Detect SGLang, plan, start every server (speculating with the EAGLE draft folder `draft_model_path`,
        if given); returns the lines to show the user (support, differences)."""
        self.features = sglang_features(installed_sglang_version(self.config.python or sys.executable))
        self.plan = plan_for_sglang(self.rules, self.features, self.config.auto_off_on_collapse)
        self.group = launch_sglang_servers(
            self.config, self.model_path, self.run_dir, self.plan, draft_model_path, self.seed, self.on_servers_spawned
        )
        self.client = SGLangClient(
            self.group.endpoints, self.eos_token_id, self.config.request_timeout_s, self.config.max_in_flight_per_server
        )
        self._last_probes = [None] * len(self.group.endpoints)
        return [self.features.describe(), f"SD plan on SGLang: {self.plan.mode.value}", *self.plan.differences]

    def stop(self) -> None:
        if self.group is not None:
            self.group.stop()

    def generate(
        self,
        requests: Sequence[RolloutRequest],
        params: SamplingParams,
        on_server_idle: Callable[[int, float], None] | None = None,
        seed: int | None = None,
    ) -> list[Completion]:
        """Generate on the servers; see SGLangClient.generate."""
        return self._running_client().generate(requests, params, on_server_idle, seed)

    def _running_client(self) -> SGLangClient:
        if self.client is None:
            raise RuntimeError("the SGLang backend is not started: call start() first.")
        return self.client

    def sync_weights(
        self,
        weight_version: str,
        target_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
        target_dir: str | Path | None = None,
        drafter_state: Mapping[str, torch.Tensor] | None = None,
        probe_prompts: Sequence[Sequence[int]] = (),
    ) -> SyncReport:
        """Push the new policy (CUDA tensors if colocated, else `target_dir`) and drafter, then probe every server.

        Call it between rollouts: SGLang flushes its prefix cache after an update and fails the
        update if requests are still running. Every server is updated before any is probed. A
        server whose drafter was accepted at the previous probe and no longer is goes into
        `report.collapsed` (the run can go on and show it); WeightSyncError if a server still
        serves another weight version.
        """
        self._running_client()
        report = SyncReport(weight_version=weight_version, drafter_pushed=False)
        tensors = self._target_payload(target_parameters, target_dir)
        drafter = drafter_tensors(drafter_state) if drafter_state is not None else None
        for endpoint in self.group.endpoints:
            if tensors is not None:
                push_tensors(endpoint, self.features, tensors, "target", self.config.tp_size, weight_version)
            else:
                push_target_from_disk(endpoint, target_dir, weight_version)
            if drafter is not None and self._can_push_drafter(report):
                push_tensors(endpoint, self.features, drafter, "draft", self.config.tp_size, weight_version)
                report.drafter_pushed = True
        if probe_prompts:
            self._probe_every_server(report, probe_prompts)
        return report

    def _probe_every_server(self, report: SyncReport, probe_prompts: Sequence[Sequence[int]]) -> None:
        """Probe each server; a collapse is noted in the report (once, until acceptance recovers), not raised."""
        for index, endpoint in enumerate(self.group.endpoints):
            probe = probe_accept_length(endpoint, probe_prompts, self.config.probe_max_new_tokens, self.eos_token_id)
            try:
                check_sync_landed(
                    endpoint, self._last_probes[index], probe, report.weight_version, self.config.collapse_accept_length
                )
            except AcceptLengthCollapsed as collapse:
                report.collapsed.append(str(collapse))
            self._last_probes[index] = probe
            report.probes.append(probe)

    def _target_payload(
        self, target_parameters: Iterable[tuple[str, torch.Tensor]] | None, target_dir: str | Path | None
    ) -> list[tuple[str, torch.Tensor]] | None:
        if self.config.colocated:
            if target_parameters is None:
                raise WeightSyncError(
                    "rollout.sglang.colocated is true: pass target_parameters (the policy's CUDA tensors)."
                )
            return target_tensors(target_parameters, self.tie_word_embeddings)
        if target_dir is None:
            raise WeightSyncError(
                "rollout.sglang.colocated is false: pass target_dir, a checkpoint folder the servers can read."
            )
        return None

    def _can_push_drafter(self, report: SyncReport) -> bool:
        reason = None
        if self.plan.mode is PlanMode.off:
            reason = "SD is off on the servers"
        elif self.plan.mode is PlanMode.ngram:
            reason = "the servers draft with SGLang's NGRAM, not the drafter"
        elif not self.features.drafter_sync:
            reason = f"SGLang {self.features.version} has no draft selector (0.5.21 and later)"
        elif not self.config.colocated:
            reason = "updates from disk cannot select the draft model"
        if reason is not None and not report.notes:
            report.notes.append(f"drafter not pushed: {reason}; the servers keep the drafter they started with.")
        return reason is None
