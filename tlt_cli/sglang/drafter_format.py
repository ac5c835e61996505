"""tlt's drafter in SGLang's EAGLE draft-model format: the config, the tensors, the folder, the reload check.

SGLang serves an EAGLE draft model from a Hugging Face-style folder:
  config.json          the target's config with one layer, architectures [Qwen2|Llama]ForCausalLMEagle
  model.safetensors    fc.weight, fc.bias, layers.0.* (names from tlt_cli/sglang/weight_sync.py),
                       plus embed_tokens.weight / lm_head.weight when the shared weights are included
`write_drafter_folder` writes one (the SGLang rollout backend launches its servers with it;
`tlt export-drafter`, tlt_cli/export.py, writes the same files and a model card), and
`load_exported_drafter` reads one back into tlt's drafter, refusing anything tlt did not write,
which is how an export checks itself before it is renamed into place. Layout checked against
SGLang 0.5.23's source (models/llama_eagle.py, models/qwen2_eagle.py, speculative/eagle_worker_v2.py).
A drafter over a reduced draft vocabulary also needs the token map SGLang's
`--speculative-token-map` reads (`save_token_map`, TOKEN_MAP_FILE in the folder; `load_token_map` reads
it back; checked against SGLang 0.5.23's own `spec_utils.load_token_map` by tests/test_sglang_real_export.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from tlt_cli.drafter.model import EagleDrafter
from tlt_cli.drafter.vocabulary import DraftVocabulary
from tlt_cli.errors import UserError
from tlt_cli.sglang.weight_sync import drafter_tensors

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
# a reduced draft vocabulary's target ids, as --speculative-token-map reads them (`save_token_map`)
TOKEN_MAP_FILE = "token_map.pt"
SGLANG_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLMEagle", "llama": "LlamaForCausalLMEagle"}
SGLANG_VERSIONS_CHECKED = "0.5.23"
SHARED_NAMES = ("embed_tokens.weight", "lm_head.weight")


class DrafterFormatError(UserError):
    """A drafter that cannot be written in, or read back from, SGLang's format; the message says why."""


def sglang_architecture(target: PreTrainedModel) -> str:
    model_type = target.config.model_type
    if model_type not in SGLANG_ARCHITECTURES:
        raise DrafterFormatError(
            f"SGLang has no EAGLE draft class for a {model_type!r} target; tlt exports Qwen2 and Llama drafters."
        )
    return SGLANG_ARCHITECTURES[model_type]


def sglang_config(drafter: EagleDrafter, target: PreTrainedModel) -> dict:
    """The drafter's config (the target's, one layer) as SGLang's EAGLE loader reads it."""
    config = {name: value for name, value in drafter.config.to_dict().items() if not name.startswith("_")}
    config["architectures"] = [sglang_architecture(target)]
    config["num_hidden_layers"] = 1
    config["dtype"] = str(next(drafter.parameters()).dtype).removeprefix("torch.")
    rope_parameters = config.get("rope_parameters") or {}
    if "rope_theta" in rope_parameters:
        # loaders written for transformers 4 read rope_theta at the top level
        config["rope_theta"] = rope_parameters["rope_theta"]
    return config


def sglang_tensors(drafter: EagleDrafter, target: PreTrainedModel, include_shared: bool) -> dict[str, torch.Tensor]:
    """Checkpoint tensors under SGLang's EAGLE names; the shared embedding and lm_head only with include_shared."""
    tensors = dict(drafter_tensors(drafter.state_dict()))
    if include_shared:
        tensors["embed_tokens.weight"] = target.get_input_embeddings().weight.detach()
        if not target.config.tie_word_embeddings:
            tensors["lm_head.weight"] = target.get_output_embeddings().weight.detach()
    return {name: tensor.contiguous().cpu() for name, tensor in tensors.items()}


def write_drafter_folder(drafter: EagleDrafter, target: PreTrainedModel, directory: Path) -> Path:
    """Write the drafter as an SGLang EAGLE draft folder (config.json, model.safetensors, no shared weights)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_FILE).write_text(json.dumps(sglang_config(drafter, target), indent=2), encoding="utf-8")
    save_file(sglang_tensors(drafter, target, include_shared=False), str(directory / WEIGHTS_FILE))
    return directory


def load_exported_drafter(export_dir: Path, target: PreTrainedModel) -> EagleDrafter:
    """Rebuild tlt's drafter from an SGLang draft folder (the inverse of `sglang_tensors`); DrafterFormatError on
    any mismatch."""
    config = json.loads((export_dir / CONFIG_FILE).read_text(encoding="utf-8"))
    expected = sglang_architecture(target)
    if config.get("architectures") != [expected] or config.get("hidden_size") != target.config.hidden_size:
        raise DrafterFormatError(
            f"{export_dir} is a {config.get('architectures')} drafter of hidden size {config.get('hidden_size')}, "
            f"not a {expected} drafter for this target."
        )
    drafter = EagleDrafter(target, vocabulary=load_token_map(export_dir, target))
    state = {}
    for name, tensor in load_file(str(export_dir / WEIGHTS_FILE)).items():
        if name == "fc.bias":
            if bool(tensor.any()):
                raise DrafterFormatError(
                    f"{export_dir}: fc.bias is not zero, and tlt's drafter has no fc bias; it was not exported by tlt."
                )
        elif name in SHARED_NAMES:
            shared = target.get_input_embeddings() if name == "embed_tokens.weight" else target.get_output_embeddings()
            if not torch.equal(tensor, shared.weight.detach().cpu()):
                raise DrafterFormatError(
                    f"{export_dir}: {name} differs from the target's; the export belongs to another target."
                )
        elif name == "fc.weight" or name.startswith("layers.0."):
            state[name.replace("layers.0.", "decoder_layer.", 1)] = tensor
        else:
            raise DrafterFormatError(f"{export_dir}: tensor {name!r} is not part of an EAGLE drafter exported by tlt.")
    try:
        drafter.load_state_dict(state, strict=True)
    except RuntimeError as error:
        raise DrafterFormatError(
            f"{export_dir}: the weights do not fit this target's drafter ({str(error).splitlines()[0]})."
        ) from None
    return drafter


def load_token_map(export_dir: Path, target: PreTrainedModel) -> DraftVocabulary:
    """The draft vocabulary of an export: its TOKEN_MAP_FILE if it has one, else the target's whole vocabulary."""
    path = export_dir / TOKEN_MAP_FILE
    if not path.is_file():
        return DraftVocabulary.full(target.config.vocab_size)
    try:
        return DraftVocabulary(torch.load(path, weights_only=True), target.config.vocab_size)
    except (ValueError, RuntimeError) as error:
        raise DrafterFormatError(f"{path} is not a token map of this target's vocabulary: {error}") from None


def save_token_map(vocabulary: DraftVocabulary, path: Path) -> None:
    """Write the kept target ids as SGLang's `--speculative-token-map` reads them: a 1-D int64
    tensor saved with torch.save, loaded with torch.load(weights_only=True); draft id i is
    target id map[i] (SGLang keeps lm_head rows map[i] as its draft head)."""
    if not vocabulary.is_reduced:
        raise ValueError(
            "a full draft vocabulary has no token map; SGLang drafts over the whole vocabulary without one."
        )
    torch.save(vocabulary.target_ids.detach().cpu().to(torch.int64).clone(), path)
