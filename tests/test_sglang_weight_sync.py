"""Weight-sync payload names against the names SGLang's loaders expect.

The expected names and loading rules below were read from SGLang 0.5.23's source
(sglang/srt/models/qwen2.py and llama.py: `_legacy_load_weights`; llama_eagle.py and
qwen2_eagle.py: `LlamaForCausalLMEagle` / `Qwen2ForCausalLMEagle.load_weights`):

- the target's parameters are fused: q/k/v_proj load into `self_attn.qkv_proj` as shards q, k, v;
  gate/up_proj into `mlp.gate_up_proj` as shards 0, 1; other names must match a parameter;
  a name that matches nothing is skipped with only a log warning (the update "succeeds");
- with tie_word_embeddings, `lm_head` is the embedding and has no parameter of its own;
- the EAGLE draft prefixes "model." to every name without "lm_head" and drops lm_head names; its
  own parameters are `model.fc.weight`, `model.fc.bias` (nn.Linear with bias), and one decoder
  layer `model.layers.0.*` without `input_layernorm`; the embedding and lm_head come from the
  target; there is no final norm.
"""

from __future__ import annotations

import base64
import pickle

import pytest
import torch
from tiny_models import tiny_llama, tiny_qwen2

from tlt_cli.drafter.model import EagleDrafter
from tlt_cli.sglang.version import sglang_features
from tlt_cli.sglang.weight_sync import (
    WeightSyncError,
    drafter_tensors,
    serialize_for_ranks,
    shareable,
    target_tensors,
    tensor_update_body,
    write_checkpoint,
)

torch.set_num_threads(1)
STACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
SHARDS = {"qkv_proj": {"q", "k", "v"}, "gate_up_proj": {0, 1}}


def sglang_layer_parameters(prefix: str, attention_bias: bool, with_input_norm: bool) -> set[str]:
    names = {
        f"{prefix}.self_attn.qkv_proj.weight",
        f"{prefix}.self_attn.o_proj.weight",
        f"{prefix}.mlp.gate_up_proj.weight",
        f"{prefix}.mlp.down_proj.weight",
        f"{prefix}.post_attention_layernorm.weight",
    }
    if attention_bias:
        names.add(f"{prefix}.self_attn.qkv_proj.bias")
    if with_input_norm:
        names.add(f"{prefix}.input_layernorm.weight")
    return names


def sglang_target_parameters(layers: int, attention_bias: bool, tied: bool) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"} | ({"lm_head.weight"} if not tied else set())
    for layer in range(layers):
        names |= sglang_layer_parameters(f"model.layers.{layer}", attention_bias, with_input_norm=True)
    return names


def sglang_draft_own_parameters(attention_bias: bool) -> set[str]:
    """The EAGLE draft's parameters that are not the target's shared embedding / lm_head."""
    return {"model.fc.weight", "model.fc.bias"} | sglang_layer_parameters(
        "model.layers.0", attention_bias, with_input_norm=False
    )


def sglang_load(names: list[str], parameters: set[str]) -> tuple[dict[str, set], list[str]]:
    """Apply SGLang's loading rule: (parameter -> shards loaded, names it would skip silently)."""
    loaded: dict[str, set] = {}
    skipped = []
    for name in names:
        for shard_name, (fused, shard) in STACKED.items():
            if f".{shard_name}." in name:
                name, shard_id = name.replace(shard_name, fused), shard
                break
        else:
            shard_id = None
        if name not in parameters:
            skipped.append(name)
            continue
        loaded.setdefault(name, set()).add(shard_id)
    return loaded, skipped


def assert_complete(loaded: dict[str, set], parameters: set[str]) -> None:
    assert set(loaded) == parameters, f"never loaded: {sorted(parameters - set(loaded))}"
    for name, shards in loaded.items():
        fused = next((key for key in SHARDS if f".{key}." in name), None)
        assert shards == (SHARDS[fused] if fused else {None}), name


def tiny_target(kind: str, tied: bool):
    build = tiny_qwen2 if kind == "qwen2" else tiny_llama
    return build(64, tie_word_embeddings=tied)


@pytest.mark.parametrize("kind, tied", [("qwen2", True), ("qwen2", False), ("llama", False), ("llama", True)])
def test_target_payload_fills_every_sglang_parameter_and_nothing_is_skipped(kind, tied):
    model = tiny_target(kind, tied)
    attention_bias = kind == "qwen2"
    # state_dict() lists a tied lm_head.weight too: it must be dropped, not sent to be skipped
    names = [name for name, _ in target_tensors(model.state_dict().items(), tie_word_embeddings=tied)]
    loaded, skipped = sglang_load(names, sglang_target_parameters(2, attention_bias, tied))
    assert skipped == []
    assert_complete(loaded, sglang_target_parameters(2, attention_bias, tied))


def test_wrapped_parameter_names_are_refused_because_sglang_would_ignore_them():
    model = tiny_target("qwen2", tied=True)
    with pytest.raises(
        WeightSyncError, match="'module.model.embed_tokens.weight' is not a Hugging Face checkpoint name"
    ):
        target_tensors(
            [("module." + name, tensor) for name, tensor in model.named_parameters()], tie_word_embeddings=True
        )


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_drafter_payload_fills_sglang_eagle_draft(kind):
    target = tiny_target(kind, tied=False)
    drafter = EagleDrafter(target, seed=0)
    tensors = drafter_tensors(drafter.state_dict())
    # the EAGLE draft's load_weights prefixes "model." and drops lm_head names
    names = ["model." + name for name, _ in tensors if "lm_head" not in name]
    loaded, skipped = sglang_load(names, sglang_draft_own_parameters(attention_bias=kind == "qwen2"))
    assert skipped == []
    assert_complete(loaded, sglang_draft_own_parameters(attention_bias=kind == "qwen2"))
    by_name = dict(tensors)
    assert torch.equal(by_name["fc.bias"], torch.zeros(32)), "tlt's fc has no bias: SGLang must get zeros"
    assert torch.equal(by_name["fc.weight"], drafter.fc.weight)
    assert torch.equal(by_name["layers.0.mlp.down_proj.weight"], drafter.decoder_layer.mlp.down_proj.weight)


def test_target_names_sent_to_the_draft_would_all_be_skipped():
    """Why the draft needs its own selector: target names never land in the EAGLE draft (nor corrupt it)."""
    model = tiny_target("qwen2", tied=False)
    names = ["model." + name for name, _ in target_tensors(model.named_parameters(), False) if "lm_head" not in name]
    loaded, skipped = sglang_load(names, sglang_draft_own_parameters(attention_bias=True))
    assert loaded == {} and len(skipped) == len(names)


def test_unknown_drafter_tensor_is_refused():
    with pytest.raises(WeightSyncError, match="'extra_norm.weight' has no place"):
        drafter_tensors({"fc.weight": torch.zeros(4, 8), "extra_norm.weight": torch.zeros(4)})


def test_cpu_tensors_are_sent_as_shared_memory_files_sglang_unpickles():
    """SGLang's CPU platform opens CPU tensors by shared-memory file name (its unpickler allows
    rebuild_storage_filename, never a file descriptor, which cannot travel in JSON)."""
    policy_weight = torch.arange(4.0)
    sent = shareable([("model.norm.weight", policy_weight)])
    before = torch.multiprocessing.get_sharing_strategy()
    payload = base64.b64decode(serialize_for_ranks(sent, tp_size=1)[0])
    assert b"rebuild_storage_filename" in payload and b"rebuild_storage_fd" not in payload
    assert torch.multiprocessing.get_sharing_strategy() == before
    # the live parameter is copied, never moved into shared memory
    assert not policy_weight.is_shared() and sent[0][1].is_shared()
    assert torch.equal(pickle.loads(payload)[0][1], policy_weight)


def test_tensor_update_body_per_version():
    serialized = ["a", "b"]
    new = tensor_update_body(serialized, "draft", sglang_features("0.5.23"), "step-4")
    assert new == {
        "serialized_named_tensors": ["a", "b"],
        "weight_version": "step-4",
        "flush_cache": True,
        "selector": "draft",
    }
    old = tensor_update_body(serialized, "target", sglang_features("0.5.20"), "step-4")
    assert old["disable_draft_model"] is True and "selector" not in old
    with pytest.raises(ValueError, match="role must be one of"):
        tensor_update_body(serialized, "all", sglang_features("0.5.23"), "v")


def test_checkpoint_for_disk_update_round_trips(tmp_path):
    from safetensors.torch import load_file

    model = tiny_target("llama", tied=False)
    directory = write_checkpoint(target_tensors(model.named_parameters(), False), tmp_path / "step-1")
    loaded = load_file(str(directory / "model.safetensors"))
    assert set(loaded) == {name for name, _ in model.named_parameters()}
    assert torch.equal(loaded["model.norm.weight"], model.model.norm.weight)
