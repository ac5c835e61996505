"""What a run was trained from: a model folder's identity, recorded at run start and compared on `--resume`.

`model_identity(model_path, trust_remote_code)` is a JSON-ready dict: the config (config.json as
transformers reads it, without the keys that say where or by which version it was saved), every
weight tensor's shape, and a digest of the weights that reads fixed slices of each tensor (its first
and last rows along the first dimension) instead of whole files: a model trained further, or another
model of the same shape, differs there, and reading them costs milliseconds. The run directory keeps
it (tlt_cli/processes/run_directory.py); `identity_difference(recorded, current)` says in words how
the model now at model.path differs, or None, so the driver refuses such a resume before any worker
starts instead of letting the checkpoint load fail (size mismatches) or silently train another model.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tlt_cli.models.loading import bin_weights, load_config_and_tokenizer, model_folder

# config.json keys that say where and how a model was saved, not what it is
UNSAVED_CONFIG_KEYS = ("_name_or_path", "transformers_version", "_commit_hash")


def model_identity(model_path: str, trust_remote_code: bool = False) -> dict[str, Any]:
    """{"config": ..., "shapes": {name: shape}, "weights_digest": hex} of the model at `model_path`."""
    config, _ = load_config_and_tokenizer(model_path, trust_remote_code)
    settings = json.loads(config.to_json_string(use_diff=False))
    shapes, digest = {}, hashlib.sha256()
    for name, shape, rows in sorted(_tensor_rows(model_folder(model_path))):
        shapes[name] = shape
        digest.update(name.encode())
        digest.update(rows)
    return {
        "config": {key: value for key, value in settings.items() if key not in UNSAVED_CONFIG_KEYS},
        "shapes": shapes,
        "weights_digest": digest.hexdigest(),
    }


def identity_difference(recorded: dict[str, Any], current: dict[str, Any]) -> str | None:
    """How `current` differs from `recorded`, in words for one sentence (the first difference found), or None."""
    before, now = recorded.get("config", {}), current["config"]
    changed = sorted(key for key in before.keys() | now.keys() if before.get(key) != now.get(key))
    if changed:
        shown = ", ".join(f"{key} {before.get(key)} vs {now.get(key)}" for key in changed[:3])
        return f"config.json differs: {shown}{' and more' if len(changed) > 3 else ''}"
    before, now = recorded.get("shapes", {}), current["shapes"]
    for name in sorted(before.keys() | now.keys()):
        if before.get(name) != now.get(name):
            return f"weight {name} was {before.get(name, 'absent')}, now {now.get(name, 'absent')}"
    if recorded.get("weights_digest") != current["weights_digest"]:
        return "same config and shapes, but other weight values"
    return None


def _tensor_rows(model_dir: Path) -> Iterator[tuple[str, list[int], bytes]]:
    """(name, shape, bytes of its first and last rows) of every weight tensor of the folder's weight files."""
    safetensors_files = sorted(model_dir.glob("*.safetensors"))
    for path in safetensors_files:
        with safe_open(str(path), framework="pt") as tensors:
            for name in tensors.keys():
                tensor_slice = tensors.get_slice(name)
                shape = list(tensor_slice.get_shape())
                if not shape or shape[0] <= 2:
                    rows = tensors.get_tensor(name)
                else:
                    rows = torch.cat([tensor_slice[:1], tensor_slice[shape[0] - 1 :]])
                yield name, shape, _raw_bytes(rows)
    if safetensors_files:
        return
    for path in sorted(model_dir.glob("*.bin")):
        for name, tensor in bin_weights(path).items():
            rows = tensor if tensor.dim() == 0 or len(tensor) <= 2 else torch.cat([tensor[:1], tensor[-1:]])
            yield name, list(tensor.shape), _raw_bytes(rows)


def _raw_bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's values as stored (any dtype, bfloat16 included)."""
    return tensor.contiguous().flatten().view(torch.uint8).numpy().tobytes()
