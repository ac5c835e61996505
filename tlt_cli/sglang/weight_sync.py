"""Push the actor's and the drafter's new weights into running SGLang servers, and check they landed.

Target (the policy): colocated servers take the actor's CUDA tensors over CUDA IPC
(`push_tensors(..., role="target")`, SGLang's /update_weights_from_tensor; CPU tensors go through
shared memory, SGLang's CPU platform); otherwise the
trainer writes a checkpoint (`write_checkpoint`) and `push_target_from_disk` has the server reload
it (/update_weights_from_disk). Drafter: `push_tensors(..., role="draft")` with SGLang's draft
selector, which only 0.5.21 and later have (`SGLangFeatures.drafter_sync`); older servers keep the
drafter they were launched with. There is no draft selector for updates from disk.

Names: `target_tensors` keeps Hugging Face checkpoint names (`model.layers.N...`, `lm_head.weight`),
which SGLang's Qwen2 / Llama loaders map onto their fused qkv_proj / gate_up_proj; a name they do
not know is skipped by SGLang without an error, so tlt refuses such names itself.
`drafter_tensors` renames tlt's `EagleDrafter` state to the checkpoint names of SGLang's
`LlamaForCausalLMEagle` / `Qwen2ForCausalLMEagle` (which prefix "model." on load): `fc.weight`,
`fc.bias` (SGLang's fc has a bias, tlt's has none: zeros are sent), `layers.0.<...>`. The
embedding and lm_head are the target's, shared inside SGLang, and never sent.

After a sync, `probe_accept_length` decodes a few prompts greedily at batch size 1 and
`check_sync_landed` raises `AcceptLengthCollapsed` if a drafter that was accepted before the sync
now gets (almost) nothing accepted: the silent failure of a bad draft-weight sync.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.multiprocessing import reductions

from tlt_cli.sglang.transport import ServerEndpoint, SGLangRequestError, get_json, post_json
from tlt_cli.sglang.version import SGLangFeatures
from tlt_cli.speculative.types import accept_length

TARGET_PREFIXES = ("model.", "lm_head.")
ROLES = ("target", "draft")
# index of the device in the argument tuple torch's reduce_tensor returns for a CUDA tensor
REDUCE_TENSOR_DEVICE_INDEX = 6
CHECKPOINT_FILE = "model.safetensors"


class WeightSyncError(RuntimeError):
    """Weights could not be pushed into an SGLang server, or did not land."""


class AcceptLengthCollapsed(WeightSyncError):
    """After a sync, the drafter's accept length fell to about 1.0 (no draft token accepted)."""


@dataclass(frozen=True)
class ProbeResult:
    """Acceptance over the probe prompts; accept_length: tlt_cli/rollout/types.py's, None if SD did not run."""

    accept_length: float | None
    verify_passes: int
    accepted_draft_tokens: int
    # the weight version the server reported with its answers (None if it reports none)
    weight_version: str | None


def server_version(endpoint: ServerEndpoint, timeout_s: float = 10.0) -> str:
    """The SGLang version a running server reports (/server_info; /get_server_info on older releases)."""
    try:
        info = get_json(endpoint, "/server_info", timeout_s)
    except SGLangRequestError:
        info = get_json(endpoint, "/get_server_info", timeout_s)
    if "version" not in info:
        raise WeightSyncError(f"SGLang server {endpoint.index} did not report its version in /server_info.")
    return str(info["version"])


def target_tensors(
    named_parameters: Iterable[tuple[str, torch.Tensor]], tie_word_embeddings: bool
) -> list[tuple[str, torch.Tensor]]:
    """The policy's parameters under their checkpoint names; lm_head is dropped when tied to the embedding."""
    tensors = []
    for name, tensor in named_parameters:
        if not name.startswith(TARGET_PREFIXES):
            raise WeightSyncError(
                f"parameter '{name}' is not a Hugging Face checkpoint name (model.* or lm_head.*); "
                "SGLang would skip it silently: pass the parameters of the unwrapped model (model.named_parameters())."
            )
        if tie_word_embeddings and name == "lm_head.weight":
            continue
        tensors.append((name, tensor.detach()))
    return tensors


def drafter_tensors(drafter_state: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """tlt EagleDrafter state_dict -> SGLang EAGLE draft checkpoint names (before SGLang's "model." prefix)."""
    tensors = []
    for name, tensor in drafter_state.items():
        if name.startswith("rotary_emb."):
            continue
        if name == "fc.weight" or name == "fc.bias":
            tensors.append((name, tensor.detach()))
        elif name.startswith("decoder_layer."):
            tensors.append(("layers.0." + name.removeprefix("decoder_layer."), tensor.detach()))
        else:
            raise WeightSyncError(f"drafter tensor '{name}' has no place in SGLang's EAGLE draft model (fc, layers.0).")
    if "fc.bias" not in drafter_state:
        fc_weight = drafter_state["fc.weight"]
        # SGLang's fc is Linear(2H, H) with a bias; tlt's has none, which is a zero bias
        tensors.append(("fc.bias", torch.zeros(fc_weight.shape[0], dtype=fc_weight.dtype, device=fc_weight.device)))
    return tensors


class _SharedTensorPickler(ForkingPickler):
    """Pickles tensors as handles another process on this node opens without a copy through HTTP.

    CUDA tensors become CUDA IPC handles whose device is named by UUID, as SGLang's loader accepts.
    CPU tensors (SGLang's CPU platform) become shared-memory files named in the pickle (torch's
    "file_system" sharing: SGLang's unpickler rebuilds them with `rebuild_storage_filename`; the
    default "file_descriptor" sharing passes descriptors, which cannot travel in a JSON body).
    """

    def reducer_override(self, obj: object):
        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        if not obj.is_cuda:
            return reductions.reduce_tensor(obj)
        rebuild, arguments = reductions.reduce_tensor(obj)
        # a UUID names the same GPU in processes with different CUDA_VISIBLE_DEVICES; an index does not
        device_uuid = str(torch.cuda.get_device_properties(arguments[REDUCE_TENSOR_DEVICE_INDEX]).uuid)
        index = REDUCE_TENSOR_DEVICE_INDEX
        return rebuild, (*arguments[:index], device_uuid, *arguments[index + 1 :])


@contextmanager
def _file_system_sharing():
    """torch's "file_system" sharing strategy for the duration of one serialization (restored after)."""
    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        torch.multiprocessing.set_sharing_strategy(previous)


def shareable(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The tensors as they are sent: CUDA tensors as they are, CPU tensors copied (sharing moves a CPU
    tensor's storage into shared memory, which must not happen to the live policy's parameters)."""
    return [(name, tensor if tensor.is_cuda else tensor.detach().clone()) for name, tensor in named_tensors]


def serialize_for_ranks(named_tensors: Sequence[tuple[str, torch.Tensor]], tp_size: int) -> list[str]:
    """One base64 pickle of the (name, tensor) list per tensor-parallel rank; each rank opens only its own.

    Keep `named_tensors` referenced until the server has answered: the handles point into their memory.
    """
    serialized = []
    with _file_system_sharing():
        for _rank in range(tp_size):
            buffer = io.BytesIO()
            _SharedTensorPickler(buffer).dump(list(named_tensors))
            serialized.append(base64.b64encode(buffer.getvalue()).decode())
    return serialized


def tensor_update_body(serialized: list[str], role: str, features: SGLangFeatures, weight_version: str) -> dict:
    """The /update_weights_from_tensor body for `role` ("target" or "draft") on this SGLang release."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got '{role}'.")
    body = {"serialized_named_tensors": serialized, "weight_version": weight_version, "flush_cache": True}
    if features.weight_selector:
        body["selector"] = role
    elif role == "draft":
        raise WeightSyncError(
            f"SGLang {features.version} cannot update the draft model alone (the selector came in 0.5.21); "
            "install sglang==0.5.23 or keep the drafter fixed (restart the servers with a new draft path)."
        )
    else:
        body["disable_draft_model"] = True
    return body


def _require_success(answer: dict, endpoint: ServerEndpoint, action: str) -> None:
    if not answer.get("success", False):
        raise WeightSyncError(
            f"SGLang server {endpoint.index} failed to {action}: {answer.get('message', 'no message')}."
        )


def push_tensors(
    endpoint: ServerEndpoint,
    features: SGLangFeatures,
    named_tensors: Sequence[tuple[str, torch.Tensor]],
    role: str,
    tp_size: int,
    weight_version: str,
    timeout_s: float = 600.0,
) -> None:
    """Update `role`'s weights in one server from tensors on its node (CUDA IPC, or shared memory for CPU
    tensors); keeps them referenced until it answers."""
    sent = shareable(named_tensors)
    send_tensor_update(endpoint, features, serialize_for_ranks(sent, tp_size), role, weight_version, timeout_s)


def send_tensor_update(
    endpoint: ServerEndpoint,
    features: SGLangFeatures,
    serialized: list[str],
    role: str,
    weight_version: str,
    timeout_s: float = 600.0,
) -> None:
    """POST already serialized tensors, inside a begin/end session on releases that require one."""
    body = tensor_update_body(serialized, role, features, weight_version)
    if not features.weight_selector:
        _require_success(
            post_json(endpoint, "/update_weights_from_tensor", body, timeout_s), endpoint, f"update {role} weights"
        )
        return
    # 0.5.21+: tensor updates are only accepted inside a begin/end session for the same runners
    _require_success(
        post_json(endpoint, "/begin_weight_update", {"selector": role}, timeout_s), endpoint, "open a weight update"
    )
    try:
        answer = post_json(endpoint, "/update_weights_from_tensor", body, timeout_s)
    finally:
        _require_success(post_json(endpoint, "/end_weight_update", {}, timeout_s), endpoint, "close the weight update")
    _require_success(answer, endpoint, f"update {role} weights")


def write_checkpoint(named_tensors: Sequence[tuple[str, torch.Tensor]], directory: str | Path) -> Path:
    """Write the tensors as one safetensors file, the layout /update_weights_from_disk reads."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(
        {name: tensor.detach().contiguous().cpu() for name, tensor in named_tensors}, str(directory / CHECKPOINT_FILE)
    )
    return directory


def push_target_from_disk(
    endpoint: ServerEndpoint, model_dir: str | Path, weight_version: str, timeout_s: float = 1800.0
) -> None:
    """Have one server reload the policy from `model_dir` (a folder of *.safetensors the server can read)."""
    body = {"model_path": str(model_dir), "weight_version": weight_version, "flush_cache": True}
    _require_success(
        post_json(endpoint, "/update_weights_from_disk", body, timeout_s), endpoint, f"load weights from {model_dir}"
    )


def probe_accept_length(
    endpoint: ServerEndpoint,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_token_id: int,
    timeout_s: float = 300.0,
) -> ProbeResult:
    """Greedy-decode each prompt alone (batch size 1, where SD is on) and pool the acceptance."""
    verify_passes, accepted, weight_version = 0, 0, None
    for prompt in prompts:
        body = {
            "input_ids": list(prompt),
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "stop_token_ids": [eos_token_id]},
        }
        meta_info = post_json(endpoint, "/generate", body, timeout_s).get("meta_info", {})
        verify_passes += int(meta_info.get("spec_verify_ct", 0))
        accepted += int(meta_info.get("spec_num_correct_drafts", 0))
        weight_version = meta_info.get("weight_version", weight_version)
    return ProbeResult(accept_length(accepted, verify_passes), verify_passes, accepted, weight_version)


def check_sync_landed(
    endpoint: ServerEndpoint,
    before: ProbeResult | None,
    after: ProbeResult,
    expected_weight_version: str,
    collapse_accept_length: float,
) -> None:
    """Raise if the server serves another weight version, or if acceptance collapsed across the sync."""
    if after.weight_version is not None and after.weight_version != expected_weight_version:
        raise WeightSyncError(
            f"SGLang server {endpoint.index} answers with weight version '{after.weight_version}', "
            f"not '{expected_weight_version}': the update did not land."
        )
    worked_before = before is not None and before.verify_passes > 0 and before.accept_length > collapse_accept_length
    if worked_before and (not after.verify_passes or after.accept_length <= collapse_accept_length):
        now = f"{after.accept_length:.2f}" if after.verify_passes else "nothing (SD did not run in the probe)"
        raise AcceptLengthCollapsed(
            f"SGLang server {endpoint.index}: accept length fell from {before.accept_length:.2f} to {now} across "
            f"the weight sync (threshold {collapse_accept_length}); the draft weights did not land or do not match "
            "the target: check the drafter names and the SGLang version."
        )
