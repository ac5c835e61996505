"""The EAGLE-style drafter: one decoder layer of the target's own architecture on top of its features.

At position t the drafter reads `fc(concat(embed(token[t+1]), target_hidden[t]))` (2H -> H, no
bias), runs it through one decoder layer whose first sublayer has no input norm, then through the
target's final norm and `lm_head`. It predicts `target_hidden[t+1]` (the `hidden` output, in the
same post-final-norm space as `target_hidden`) and therefore the token at t+2 (the `logits` output).

Draft vocabulary (tlt_cli/drafter/vocabulary.py): a drafter may propose only N of the target's V
tokens. Its head is then the target's own `lm_head` rows for those N tokens (frozen and shared,
as SGLang slices the target's head with a token map), and `logits` are over the N draft tokens;
`vocabulary.to_target_ids` maps a drafted id back to the target's. The head rows are a copy, so
`refresh_draft_head` re-reads them after the target's weights change (the speculative decoder
calls it at the start of every generate call).

The rollout engine calls `EagleDrafter.forward` while drafting (with a KV cache), the drafter
trainer calls it on whole sequences, and `save_drafter` / `load_drafter` move it to and from disk.

The decoder layer: for a target the engine's owned forward reproduces (the Llama family,
tlt_cli/engine/llama_family.py), tlt's own `DecoderLayer` (tlt_cli/engine/layers.py: the same layer
code the engine decodes with, trained with autograd, under transformers' parameter names, so saved
drafters and exports are unchanged); for any other target, the target's own transformers layer class.

Shared weights: the target's input embedding, final norm and `lm_head` are held in a plain
`SharedTargetModules` attribute, which `nn.Module` does not register, so they are referenced (never
copied), absent from `parameters()` and `state_dict()`, and never moved by `drafter.to(...)`; they
follow the target. The drafter reads them with detached weights, so no gradient ever reaches them.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from torch.func import functional_call
from transformers import DynamicCache, PretrainedConfig, PreTrainedModel

from tlt_cli.drafter.vocabulary import DraftVocabulary
from tlt_cli.engine.layers import DecoderLayer, LayerLayout, rms_norm, rotary_tables
from tlt_cli.engine.llama_family import refusal
from tlt_cli.errors import UserError

DRAFTER_FORMAT_VERSION = 1
WEIGHTS_FILE = "drafter.safetensors"
# the draft vocabulary's target ids, stored beside the weights in WEIGHTS_FILE (reduced vocabularies only)
DRAFT_TARGET_IDS = "draft_vocabulary.target_ids"
CONFIG_FILE = "drafter_config.json"
# the keys of CONFIG_FILE a load reads (drafter_metadata writes them, with draft_vocab_size)
METADATA_KEYS = (
    "architecture",
    "hidden_size",
    "target_vocab_size",
    "target_name_or_path",
    "target_fingerprint",
    "weights_sha256",
)
# keys of CONFIG_FILE that folders saved by an earlier tlt name otherwise: {old name: name now}
RENAMED_KEYS = {"vocab_size": "target_vocab_size"}
# target config fields that fix the drafter's shapes and the meaning of its inputs and outputs
FINGERPRINT_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "rope_parameters",
    "attention_bias",
    "mlp_bias",
)


class DrafterLoadError(UserError):
    """A saved drafter cannot be loaded against the given target; the message names the folder or file."""


@dataclass
class DrafterOutput:
    """hidden: [B,T,H] predicted target_hidden[t+1]; logits: [B,T,N] = the draft head of hidden, for
    token t+2, over the N draft tokens (N = V, the target's vocabulary, unless it is reduced)."""

    hidden: torch.Tensor
    logits: torch.Tensor


@dataclass(frozen=True)
class SharedTargetModules:
    """The target's own modules the drafter reads but never owns or trains."""

    embed_tokens: nn.Module
    final_norm: nn.Module
    lm_head: nn.Module


def drafter_config_from(target_config: PretrainedConfig) -> PretrainedConfig:
    """The target's config with one decoder layer, attending through SDPA (bool masks): made by the config's own
    class from the target's fields, as a saved config loads."""
    fields = {**target_config.to_dict(), "num_hidden_layers": 1, "attn_implementation": "sdpa"}
    if fields.get("layer_types") is not None:
        fields["layer_types"] = fields["layer_types"][:1]
    return type(target_config).from_dict(fields)


def target_fingerprint(target_config: PretrainedConfig) -> str:
    """sha256 over the config fields that fix the drafter's shapes and semantics."""
    fields = {name: getattr(target_config, name, None) for name in FINGERPRINT_FIELDS}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()


def causal_attention_mask(batch_size: int, query_length: int, past_length: int, device: torch.device) -> torch.Tensor:
    """[B,1,T,past+T] bool, True = attend: query i (absolute past+i) sees keys 0..past+i."""
    query_positions = torch.arange(query_length, device=device)[:, None] + past_length
    key_positions = torch.arange(past_length + query_length, device=device)[None, :]
    mask = key_positions <= query_positions
    return mask[None, None].expand(batch_size, 1, query_length, past_length + query_length)


def call_frozen(module: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """Run `module` with its weights detached: gradient flows to `inputs`, never into the weights."""
    if not torch.is_grad_enabled():
        return module(inputs)
    detached = {name: tensor.detach() for name, tensor in module.named_parameters()}
    return functional_call(module, detached, (inputs,))


class EagleDrafter(nn.Module):
    """One decoder layer of the target's architecture that predicts the target's next hidden state.

    Example:
        drafter = EagleDrafter(target, seed=0)
        out = drafter(next_token_ids, target_hidden, position_ids, None, DynamicCache())
        draft_token = out.logits[:, -1].argmax(-1)
    """

    def __init__(self, target: PreTrainedModel, seed: int = 0, vocabulary: DraftVocabulary | None = None):
        super().__init__()
        self.config = drafter_config_from(target.config)
        self.target_name_or_path = str(getattr(target.config, "_name_or_path", "") or "")
        self.target_fingerprint = target_fingerprint(target.config)
        base_model = target.get_decoder()
        self.shared = SharedTargetModules(
            embed_tokens=target.get_input_embeddings(),
            final_norm=base_model.norm,
            lm_head=target.get_output_embeddings(),
        )
        hidden_size = self.config.hidden_size
        target_layer = base_model.layers[0]
        # the target's layer class names the architecture in saved drafters and exports, whichever code runs it
        self._architecture = type(target_layer).__name__
        self.owned_layer = refusal(target) is None
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
            if self.owned_layer:
                self.decoder_layer = DecoderLayer(self.config, LayerLayout.of(target_layer))
            else:
                self.decoder_layer = type(target_layer)(self.config, layer_idx=0)
        # EAGLE: the fc output enters attention un-normalised
        self.decoder_layer.input_layernorm = nn.Identity()
        reference = target.get_input_embeddings().weight
        self.to(device=reference.device, dtype=reference.dtype)
        # built after the dtype cast so its inverse frequencies stay float32, as in the target
        self.rotary_emb = type(base_model.rotary_emb)(config=self.config).to(reference.device)
        self.vocabulary = (vocabulary or DraftVocabulary.full(self.target_vocab_size)).to(reference.device)
        if self.vocabulary.target_size != self.target_vocab_size:
            raise ValueError(
                f"the draft vocabulary maps into {self.vocabulary.target_size} target tokens, but the target has "
                f"{self.target_vocab_size}."
            )
        # [N, H] and [N] or None: the target lm_head's rows of the draft tokens (reduced vocabularies)
        self.draft_head_weight: torch.Tensor | None = None
        self.draft_head_bias: torch.Tensor | None = None
        self.refresh_draft_head()

    @property
    def architecture(self) -> str:
        """The target's decoder-layer class name (e.g. Qwen2DecoderLayer), as saved drafters record it."""
        return self._architecture

    @property
    def target_vocab_size(self) -> int:
        """V, the target's vocabulary (the drafter's config is a copy of the target's); the drafter
        proposes from its own N of them, `vocabulary.size`."""
        return self.config.vocab_size

    def refresh_draft_head(self) -> None:
        """Copy the target lm_head's rows of the draft tokens (a reduced vocabulary only), on the
        lm_head's device and dtype: call after the target's weights change."""
        if not self.vocabulary.is_reduced:
            return
        weight, bias = self.shared.lm_head.weight.detach(), self.shared.lm_head.bias
        self.vocabulary = self.vocabulary.to(weight.device)
        self.draft_head_weight = weight.index_select(0, self.vocabulary.target_ids)
        self.draft_head_bias = None if bias is None else bias.detach().index_select(0, self.vocabulary.target_ids)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., N]: the target's lm_head restricted to the draft tokens; gradient flows
        to `hidden` only."""
        if not self.vocabulary.is_reduced:
            return call_frozen(self.shared.lm_head, hidden)
        weight = self.shared.lm_head.weight
        if self.draft_head_weight.device != weight.device or self.draft_head_weight.dtype != weight.dtype:
            self.refresh_draft_head()
        return torch.nn.functional.linear(hidden, self.draft_head_weight, self.draft_head_bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        target_hidden: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: DynamicCache | None = None,
    ) -> DrafterOutput:
        """input_ids[:, t] is token[t+1], paired with target_hidden[:, t]; see the module docstring.

        input_ids: [B,T]; target_hidden: [B,T,H]; position_ids: [B,T] (the position of
        target_hidden[t]); attention_mask: [B,1,T,past+T] bool, True = attend, or None for causal;
        past_key_values: the drafter's own cache (updated in place) or None.
        """
        batch_size, query_length = input_ids.shape
        with torch.no_grad():
            token_embeddings = self.shared.embed_tokens(input_ids)
        # fc(concat(embed(token[t+1]), target_hidden[t])): 2H -> H
        features = self.fc(torch.cat((token_embeddings.to(self.fc.weight.dtype), target_hidden.detach()), dim=-1))
        if attention_mask is None:
            past_length = past_key_values.get_seq_length() if past_key_values is not None else 0
            attention_mask = causal_attention_mask(batch_size, query_length, past_length, input_ids.device)
        if self.owned_layer:
            # the rotary module's buffers only: no transformers module runs on this path
            rotary = rotary_tables(
                self.rotary_emb.inv_freq, self.rotary_emb.attention_scaling, position_ids, features.dtype
            )
            layer_output = self.decoder_layer(features, rotary, attention_mask, past_key_values)
            hidden = rms_norm(layer_output, self.shared.final_norm.weight.detach(), self.config.rms_norm_eps)
            return DrafterOutput(hidden=hidden, logits=self.draft_logits(hidden))
        position_embeddings = self.rotary_emb(features, position_ids)
        layer_output = self.decoder_layer(
            features,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=past_key_values is not None,
            position_embeddings=position_embeddings,
        )
        hidden = call_frozen(self.shared.final_norm, layer_output)
        return DrafterOutput(hidden=hidden, logits=self.draft_logits(hidden))


def drafter_metadata(drafter: EagleDrafter, weights_sha256: str) -> dict:
    return {
        "version": DRAFTER_FORMAT_VERSION,
        "architecture": drafter.architecture,
        "hidden_size": drafter.config.hidden_size,
        "target_vocab_size": drafter.target_vocab_size,
        "draft_vocab_size": drafter.vocabulary.size,
        "target_name_or_path": drafter.target_name_or_path,
        "target_fingerprint": drafter.target_fingerprint,
        "weights_sha256": weights_sha256,
    }


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def replace_atomically(temporary: Path, final: Path) -> None:
    with open(temporary, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(temporary, final)


def save_drafter(drafter: EagleDrafter, directory: str | Path) -> Path:
    """Write drafter.safetensors + drafter_config.json into `directory`, each via temp file + rename.

    The config carries the weights' sha256, so a crash between the two renames is caught at load.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    weights_path, config_path = directory / WEIGHTS_FILE, directory / CONFIG_FILE
    temporary_weights = directory / f".{WEIGHTS_FILE}.tmp-{os.getpid()}"
    temporary_config = directory / f".{CONFIG_FILE}.tmp-{os.getpid()}"
    tensors = {name: tensor.detach().contiguous().cpu() for name, tensor in drafter.state_dict().items()}
    if drafter.vocabulary.is_reduced:
        tensors[DRAFT_TARGET_IDS] = drafter.vocabulary.target_ids.cpu()
    save_file(tensors, str(temporary_weights))
    metadata = drafter_metadata(drafter, file_sha256(temporary_weights))
    temporary_config.write_text(json.dumps(metadata, indent=2) + "\n")
    replace_atomically(temporary_weights, weights_path)
    replace_atomically(temporary_config, config_path)
    return directory


def read_drafter_metadata(directory: Path) -> dict:
    """The drafter's config, checked: a JSON object of this format version with every key tlt writes,
    and weights whose sha256 it records; DrafterLoadError names the file otherwise."""
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not config_path.is_file() or not weights_path.is_file():
        raise DrafterLoadError(f"No saved drafter in {directory}: expected {CONFIG_FILE} and {WEIGHTS_FILE}.")
    try:
        metadata = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        reason = getattr(error, "msg", None) or "not UTF-8"
        raise DrafterLoadError(
            f"Drafter config {config_path} is not valid JSON ({reason}): save the drafter again."
        ) from None
    if not isinstance(metadata, dict):
        raise DrafterLoadError(
            f"Drafter config {config_path} is a JSON {type(metadata).__name__}, not an object: save the drafter again."
        )
    metadata = with_current_key_names(metadata)
    if metadata.get("version") != DRAFTER_FORMAT_VERSION:
        raise DrafterLoadError(
            f"Drafter in {directory} has format version {metadata.get('version')}, this tlt reads "
            f"{DRAFTER_FORMAT_VERSION}: re-save it with this version."
        )
    missing = [key for key in METADATA_KEYS if key not in metadata]
    if missing:
        raise DrafterLoadError(
            f"Drafter config {config_path} lacks {', '.join(missing)}: save the drafter again with tlt."
        )
    if metadata["weights_sha256"] != file_sha256(weights_path):
        raise DrafterLoadError(
            f"Drafter weights in {directory} do not match its config (interrupted save?): save it again."
        )
    return metadata


def with_current_key_names(metadata: dict) -> dict:
    """A drafter config under this tlt's key names. Folders saved by an earlier tlt call the target's
    vocabulary `vocab_size`, and those saved before draft vocabularies have no `draft_vocab_size`:
    they draft over the whole target vocabulary."""
    current = {RENAMED_KEYS.get(key, key): value for key, value in metadata.items()}
    if "draft_vocab_size" not in current and "target_vocab_size" in current:
        current["draft_vocab_size"] = current["target_vocab_size"]
    return current


def check_target_matches(metadata: dict, drafter: EagleDrafter, directory: Path) -> None:
    if metadata["architecture"] != drafter.architecture or metadata["target_fingerprint"] != drafter.target_fingerprint:
        raise DrafterLoadError(
            f"Drafter in {directory} was trained for a {metadata['architecture']} target "
            f"'{metadata['target_name_or_path']}' (hidden {metadata['hidden_size']}, "
            f"vocab {metadata['target_vocab_size']}), "
            f"not this {drafter.architecture} target (hidden {drafter.config.hidden_size}, vocab "
            f"{drafter.target_vocab_size}): load it with the model it was trained for."
        )


def load_drafter(directory: str | Path, target: PreTrainedModel) -> EagleDrafter:
    """Rebuild a drafter saved by `save_drafter` on top of `target` (with the draft vocabulary it
    was saved with); DrafterLoadError on any mismatch."""
    directory = Path(directory)
    metadata = read_drafter_metadata(directory)
    try:
        tensors = load_file(str(directory / WEIGHTS_FILE), device=str(target.get_input_embeddings().weight.device))
    except (SafetensorError, OSError) as error:
        raise DrafterLoadError(f"Drafter weights {directory / WEIGHTS_FILE} cannot be read ({error}).") from None
    target_ids = tensors.pop(DRAFT_TARGET_IDS, None)
    drafter = EagleDrafter(target)
    check_target_matches(metadata, drafter, directory)
    try:
        if target_ids is not None:
            drafter.vocabulary = DraftVocabulary(target_ids.long(), drafter.target_vocab_size)
            drafter.refresh_draft_head()
        drafter.load_state_dict(tensors, strict=True)
    except (RuntimeError, ValueError, IndexError) as error:
        reason = str(error).strip().splitlines()[-1].strip() if str(error).strip() else type(error).__name__
        raise DrafterLoadError(
            f"Drafter weights {directory / WEIGHTS_FILE} do not fit a drafter of this target ({reason[:200]})."
        ) from None
    return drafter
