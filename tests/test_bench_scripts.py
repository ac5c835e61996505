"""scripts/profile_update.py's categories (the side-by-side benchmarks' arithmetic moved to `tlt bench runs`:
tests/test_bench.py)."""

from __future__ import annotations

import sys

from tests.conftest import REPOSITORY

sys.path.insert(0, str(REPOSITORY / "scripts"))
import profile_update  # noqa: E402


def test_profile_update_puts_each_operators_self_time_in_one_category_and_one_phase():
    category, phase = profile_update.category, profile_update.phase
    head_backward = {"autograd::engine::evaluate_function: ChunkedHeadLogprobsBackward", "ChunkedHeadLogprobsBackward"}
    assert category("aten::mm", head_backward) == "log-prob head: products over the vocabulary"
    assert category("aten::logsumexp", {"ChunkedHeadLogprobs"}) == "log-prob head: log-softmax over the vocabulary"
    assert category("aten::addmm", {"aten::linear"}) == "matrix products"
    assert category("aten::_to_copy", {"aten::to", "aten::linear"}) == "dtype casts and copies"
    assert category("aten::addcdiv_", {"Optimizer.step#AdamW.step", profile_update.STEP_LABEL}) == (
        "optimizer step (AdamW)"
    )
    assert category("aten::norm", {profile_update.STEP_LABEL}) == (
        "DeepSpeed step (gradient norm, clipping, ZeRO copies)"
    )
    assert category("autograd::engine::evaluate_function: MmBackward0", set()) == "Python and dispatch"
    assert category("aten::_scaled_dot_product_flash_attention_for_cpu", set()) == "attention"
    assert set(profile_update.CATEGORIES) >= {"all-reduce", "other operators (norms, activations, elementwise)"}
    recomputed = {profile_update.BACKWARD_LABEL, profile_update.LAYER_LABEL, "aten::mm"}
    assert phase(recomputed) == "recomputation"
    assert phase({profile_update.BACKWARD_LABEL, "aten::mm"}) == "backward"
    assert phase({profile_update.LAYER_LABEL, "aten::mm"}) == "forward"
    assert phase({profile_update.STEP_LABEL, "aten::add_"}) == "optimizer step"
