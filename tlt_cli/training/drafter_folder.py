"""A drafter folder the user names (`drafter.init: FOLDER`, `tlt_rollout(drafter=FOLDER)`), loaded onto tlt's drafter.

Two layouts map onto tlt's drafter (tlt_cli/drafter/model.py: one decoder layer over fc(embedding, the target's
last hidden state), EAGLE-1's shape):
  - tlt's own: drafter_config.json + drafter.safetensors (`save_drafter`: a warm-up, a run checkpoint's drafter/);
  - an EAGLE draft folder as SGLang serves it: config.json + model.safetensors (fc.*, layers.0.*), with
    token_map.pt for a reduced vocabulary: what `tlt export-drafter` writes (tlt_cli/sglang/drafter_format.py).
Anything else is refused in one sentence naming what does not fit: an EAGLE-3 drafter (its fc reads three of the
target's layers and it keeps its own draft head: no map onto a drafter that reads the last hidden state), an EAGLE
checkpoint whose fc has a bias (tlt's has none), weights only as pytorch_model.bin, or a folder of neither layout.
setup.py `starting_drafter` and the TRL integration call `load_named_drafter`.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import SafetensorError, safe_open
from transformers import PreTrainedModel

from tlt_cli.drafter.model import CONFIG_FILE as TLT_CONFIG_FILE
from tlt_cli.drafter.model import DrafterLoadError, EagleDrafter, load_drafter
from tlt_cli.errors import UserError
from tlt_cli.sglang.drafter_format import CONFIG_FILE as EAGLE_CONFIG_FILE
from tlt_cli.sglang.drafter_format import WEIGHTS_FILE as EAGLE_WEIGHTS_FILE
from tlt_cli.sglang.drafter_format import load_exported_drafter

# tensor name prefixes only EAGLE-3 drafters have: its decoder layer and its draft/target token maps
EAGLE3_TENSOR_PREFIXES = ("midlayer.", "d2t", "t2d")
WHAT_LOADS = (
    "a folder tlt saved a drafter in (drafter_config.json) or one `tlt export-drafter` wrote (config.json, "
    "model.safetensors)"
)


def load_named_drafter(folder: Path, target: PreTrainedModel) -> EagleDrafter:
    """The drafter in `folder` over `target`, from either layout of the module docstring; a UserError naming what
    does not fit otherwise."""
    if (folder / TLT_CONFIG_FILE).is_file():
        try:
            return load_drafter(folder, target)
        except DrafterLoadError as error:
            raise UserError(str(error)) from None
    if (folder / EAGLE_CONFIG_FILE).is_file():
        check_eagle_folder(folder)
        return load_exported_drafter(folder, target)
    raise UserError(f"drafter folder {folder} holds no drafter: tlt loads {WHAT_LOADS}.")


def check_eagle_folder(folder: Path) -> None:
    """Refuse, in one sentence, an EAGLE-style folder tlt's drafter cannot take: its config unreadable, its
    weights not in safetensors, or an EAGLE-3 drafter."""
    config_path, weights_path = folder / EAGLE_CONFIG_FILE, folder / EAGLE_WEIGHTS_FILE
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"{config_path} is not a JSON config; tlt loads {WHAT_LOADS}.") from None
    if not isinstance(config, dict):
        raise UserError(f"{config_path} is a JSON {type(config).__name__}, not a model config; tlt loads {WHAT_LOADS}.")
    if not weights_path.is_file():
        found = "only pytorch_model.bin" if (folder / "pytorch_model.bin").is_file() else "no weights"
        raise UserError(
            f"{folder} has {found}, not {EAGLE_WEIGHTS_FILE}: save the drafter's weights as safetensors (tlt loads "
            f"{WHAT_LOADS})."
        )
    architectures = config.get("architectures")
    if any("eagle3" in str(name).lower() for name in architectures or ()) or _has_eagle3_tensors(weights_path):
        raise UserError(
            f"{folder} is an EAGLE-3 drafter: it reads three of the target's layers and drafts from a head of its own, "
            "while tlt's drafter reads the target's last hidden state (EAGLE-1's shape), so it cannot be mapped; "
            "start from `tlt drafter warmup`, or drafter.init=auto."
        )


def _has_eagle3_tensors(weights_path: Path) -> bool:
    try:
        with safe_open(str(weights_path), framework="pt") as weights:
            names = list(weights.keys())
    except (SafetensorError, OSError) as error:
        raise UserError(f"{weights_path} cannot be read as safetensors ({error}).") from None
    return any(name.startswith(EAGLE3_TENSOR_PREFIXES) for name in names)
