"""scripts/gpu_check.py runs on the CPU at a small shape and writes the JSON a GPU run is read from (slow)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPOSITORY

SCRIPT = REPOSITORY / "scripts" / "gpu_check.py"


@pytest.mark.slow
def test_gpu_check_on_cpu_at_a_small_shape_writes_speeds_and_identity(tmp_path):
    out = tmp_path / "check.json"
    arguments = ["--shape", "small", "--device", "cpu", "--batch-sizes", "1", "2", "--prompts", "2"]
    arguments += ["--max-new-tokens", "8", "--train-prompts", "8", "--held-out-prompts", "2", "--drafter-seconds", "1"]
    arguments += ["--sd-configs", "s2-k1-t3", "s3-k2-t6", "--out", str(out)]
    finished = subprocess.run([sys.executable, str(SCRIPT), *arguments], capture_output=True, text=True, timeout=1800)
    assert finished.returncode == 0, finished.stdout[-4000:] + finished.stderr[-4000:]
    results = json.loads(out.read_text())
    assert results["device"] == "cpu" and set(results["targets"]) == {"random small", "tiny"}
    random_target = results["targets"]["random small"]
    assert random_target["config"]["hidden_size"] == 64 and random_target["config"]["tie_word_embeddings"]
    for target in results["targets"].values():
        assert target["drafter_warmup"]["steps"] >= 1 and 0.0 <= target["drafter_warmup"]["held_out_accuracy"] <= 1.0
        assert target["decode_path"].startswith("decode path: owned llama-family")
        assert [batch["batch_size"] for batch in target["batches"]] == [1, 2]
        assert all(batch["transformers_calls_in_owned_decode"] == 0 for batch in target["batches"])
        for batch in target["batches"]:
            assert set(batch["methods"]) == {"generate", "off", "s2-k1-t3", "s3-k2-t6"}
            assert batch["engine_vs_generate"] > 0
            assert batch["methods"]["off"]["vs_plain"] == 1.0
            for method, row in batch["methods"].items():
                # greedy: the engine equals transformers' generate, and SD equals plain decoding
                assert row["same_as_plain"] in ("yes", "tie"), (method, row)
                assert row["tokens"] > 0 and row["tokens_per_second"] > 0
            assert all(batch["methods"][label]["accept_length"] >= 1.0 for label in ("s2-k1-t3", "s3-k2-t6"))
    assert "generate" in finished.stdout and f"wrote {out}" in finished.stdout.replace("\n", "")
