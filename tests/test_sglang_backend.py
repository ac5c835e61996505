"""SGLangBackend end to end on CPU: version detection, plan, real launch command, generation, disk sync, stop.

An importable stand-in `sglang` package (written to a temp dir on PYTHONPATH, with its own
dist-info saying 0.5.23) provides `python -m sglang.launch_server`, which logs the argv it got and
runs tests/sglang_fake_server.py on the --port and --api-key tlt passed.
"""

from __future__ import annotations

import pytest
import torch
from sglang_fakes import free_port_range, write_stand_in_sglang

from tlt_cli.engine.sampling import SamplingParams
from tlt_cli.process_status import process_running
from tlt_cli.rollout.types import RolloutRequest
from tlt_cli.sglang.adaptive import BatchRule
from tlt_cli.sglang.backend import SGLangBackend
from tlt_cli.sglang.config import SGLangConfig
from tlt_cli.sglang.weight_sync import WeightSyncError
from tlt_cli.speculative.types import SpeculativeConfig

RULES = [BatchRule(1, 4, SpeculativeConfig(3)), BatchRule(5, None, None)]


@pytest.fixture()
def stand_in_sglang(tmp_path, monkeypatch):
    site = write_stand_in_sglang(tmp_path / "site")
    monkeypatch.setenv("PYTHONPATH", str(site))
    return site


def test_backend_starts_generates_syncs_from_disk_and_stops(stand_in_sglang, tmp_path):
    config = SGLangConfig(
        gpus=(0, 1), port_base=free_port_range(4), colocated=False, startup_timeout_s=20, stop_timeout_s=5
    )
    backend = SGLangBackend(config, "/models/target", tmp_path / "run", RULES, eos_token_id=2)
    try:
        lines = backend.start("/models/drafter")
        assert (
            lines[0].startswith("SGLang 0.5.23: drafter weights pushed live")
            and lines[1] == "SD plan on SGLang: adaptive"
        )
        argv = (tmp_path / "run" / "sglang" / "server-1.log").read_text()
        assert f"--port {config.port_base + 2} --nccl-port {config.port_base + 3}" in argv
        assert (
            "--speculative-adaptive-config" in argv
            and (tmp_path / "run" / "sglang" / "adaptive_speculative.json").is_file()
        )
        completions = backend.generate(
            [RolloutRequest(index, (index + 3, 1)) for index in range(4)], SamplingParams(max_new_tokens=5)
        )
        assert [len(completion.response_ids) for completion in completions] == [5, 4, 5, 4]
        report = backend.sync_weights(
            "step-1",
            target_dir=tmp_path / "ckpt",
            drafter_state={"fc.weight": torch.zeros(2, 4)},
            probe_prompts=[(3, 1)],
        )
        assert [probe.weight_version for probe in report.probes] == ["step-1", "step-1"]
        assert not report.drafter_pushed and "updates from disk cannot select the draft model" in report.notes[0]
        with pytest.raises(WeightSyncError, match="pass target_dir"):
            backend.sync_weights("step-2")
    finally:
        backend.stop()
    assert backend.group.pids and not any(process_running(pid) for pid in backend.group.pids)


def test_backend_refuses_to_generate_before_start(tmp_path):
    backend = SGLangBackend(SGLangConfig(), "/m", tmp_path, RULES, eos_token_id=2)
    with pytest.raises(RuntimeError, match="not started"):
        backend.generate([RolloutRequest(0, (1,))], SamplingParams(max_new_tokens=2))
