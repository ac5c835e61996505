"""Load the policy model and its tokenizer: the built-in tiny model or a local Hugging Face folder.

`load_policy` is what the worker loop, the rollout engines and the profiler call. A path
`cache:<relative path>` names a folder under tlt's cache (`resolve_model_path`). Any causal LM
that transformers can build from the folder and that exposes `get_decoder()` and an output
head (`lm_head`) works: Qwen2, Llama and relatives, tied or untied embeddings. Nothing is
downloaded (`local_files_only=True`). Problems a user can cause raise `ModelLoadError` with
one sentence naming the folder and what to fix. `load_config_and_tokenizer` loads what the recipe
checks need (the vocabulary) without the weights; `check_weight_shapes` compares the names and shapes in
the safetensors headers with the model the config builds, so weights of another model, or a folder
missing a layer's tensors (which transformers would fill with random values, with only a warning), are
refused before anything loads them (by `tlt recipes validate` as by `tlt train`); .bin files, which have no
header, are read weights-only and memory-mapped for it (`bin_weights`: a pickle torch refuses, or one that
holds anything but tensors by name, is one sentence); the load itself refuses a missing or unexpected weight
too. A folder that ships its own
Python code (`auto_map` in config.json or tokenizer_config.json) is refused unless the caller passes
trust_remote_code=True (the recipe's `model.trust_remote_code`); every transformers load here says
which, so transformers never asks on the terminal.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import pickle
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging as transformers_logging

from tlt_cli.checkpoint import load_failure_reason
from tlt_cli.errors import UserError
from tlt_cli.models.tiny import BUILTIN_TINY_MODEL, SHIPPED_TINY_MODEL, default_cache_dir

# any one of these files means the folder ships a tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# a model path under tlt's cache: cache:models/<name> is $TLT_CACHE_DIR/models/<name> (else ~/.cache/tlt/...)
CACHE_PREFIX = "cache:"
# weight files a Hugging Face folder may hold (their names, sizes and times fingerprint the model)
WEIGHT_SUFFIXES = (".safetensors", ".bin")
# the files whose `auto_map` points transformers at Python code in the model folder
REMOTE_CODE_FILES = ("config.json", "tokenizer_config.json")
# config.json's sizes, each checked to be a whole number in [1, bound] before any model is built from it (a million
# layers would hang building even the meta-device model that checks weight shapes; 0 heads divides by zero)
CONFIG_SIZE_BOUNDS = {
    "num_hidden_layers": 1024,
    "hidden_size": 1 << 17,
    "intermediate_size": 1 << 20,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "head_dim": 1 << 12,
    "vocab_size": 1 << 23,
    "max_position_embeddings": 1 << 24,
}
# safetensors dtypes of floating-point tensors (a model's weights are; an integer or bool tensor of the right
# shape is damage, not weights)
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2"}


class ModelLoadError(UserError):
    """The policy model or its tokenizer cannot be loaded from the given path."""


def load_policy(
    model_path: str, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The causal LM and tokenizer at `model_path` ("builtin:tiny-arith" or a local folder).

    The tokenizer's pad token falls back to its EOS token. The model is in eval mode. The folder's
    own Python code runs only with trust_remote_code (else a folder that has some is refused).
    """
    model_dir = model_folder(model_path)
    check_remote_code(model_dir, trust_remote_code)
    check_weight_shapes(model_dir, _check_causal_lm_config(model_dir, trust_remote_code), trust_remote_code)
    tokenizer = _load_tokenizer(model_dir, trust_remote_code)
    model = _load_model(model_dir, dtype, trust_remote_code)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def unloaded_policy(
    model_path: str, device: torch.device, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False
) -> PreTrainedModel:
    """The causal LM at `model_path` as `load_policy` builds it, on `device` in `dtype`, its weights allocated but
    neither read nor initialised: for what needs only its shapes, dtypes and device (the keys of a cached
    measurement, tlt_cli/tuning/cache.py), so that a run whose measurements are all cached never reads them."""
    model_dir = model_folder(model_path)
    check_remote_code(model_dir, trust_remote_code)
    config = _check_causal_lm_config(model_dir, trust_remote_code)
    with torch.device("meta"), _without_progress_bars():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    model = model.to_empty(device=device)
    model.tie_weights()  # to_empty unties what the config ties; a loaded model holds a tied weight once
    return model.eval()


def load_config_and_tokenizer(
    model_path: str, trust_remote_code: bool = False
) -> tuple[PretrainedConfig, PreTrainedTokenizerBase]:
    """The config and tokenizer at `model_path`, checked as `load_policy` checks them, without the weights."""
    model_dir = model_folder(model_path)
    check_remote_code(model_dir, trust_remote_code)
    return _check_causal_lm_config(model_dir, trust_remote_code), _load_tokenizer(model_dir, trust_remote_code)


def remote_code_files(model_dir: Path) -> list[str]:
    """The files of `model_dir` whose `auto_map` names Python code of the folder for transformers to run."""
    named = []
    for file_name in REMOTE_CODE_FILES:
        try:
            settings = json.loads((model_dir / file_name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # absent or unreadable: the load that follows says so
        if isinstance(settings, dict) and settings.get("auto_map"):
            named.append(file_name)
    return named


def check_remote_code(model_dir: Path, trust_remote_code: bool) -> None:
    """ModelLoadError when the folder ships Python code (auto_map) and the caller does not trust it."""
    files = remote_code_files(model_dir)
    if files and not trust_remote_code:
        raise ModelLoadError(
            f"Model folder {model_dir} asks transformers to run Python code it ships (auto_map in "
            f"{' and '.join(files)}), which tlt never runs unless the recipe sets model.trust_remote_code: true; "
            "set it only for a folder whose code you trust."
        )


def model_folder(model_path: str) -> Path:
    """The Hugging Face folder `model_path` names (the built-in tiny model's shipped folder), checked."""
    if model_path == BUILTIN_TINY_MODEL:
        if not (SHIPPED_TINY_MODEL / "config.json").is_file():
            raise ModelLoadError(
                f"The built-in model folder {SHIPPED_TINY_MODEL} is missing from this install; reinstall tlt."
            )
        return SHIPPED_TINY_MODEL
    return _checked_model_dir(model_path)


def resolve_model_path(model_path: str) -> Path:
    """The folder a model path names: `cache:<relative path>` is under tlt's cache ($TLT_CACHE_DIR, else
    ~/.cache/tlt), where scripts/make_real_model.py writes; any other path has `~` expanded.

    Example: "cache:models/SmolLM2-135M-Instruct" -> ~/.cache/tlt/models/SmolLM2-135M-Instruct
    """
    if model_path.startswith(CACHE_PREFIX):
        return default_cache_dir() / model_path.removeprefix(CACHE_PREFIX)
    return Path(model_path).expanduser()


def check_weight_shapes(model_dir: Path, config: PretrainedConfig, trust_remote_code: bool = False) -> None:
    """ModelLoadError naming the first tensor of the folder's safetensors files whose shape differs from
    the model `config` builds (built on the meta device: no memory, no weights read), then the first
    tensor the model has and the files lack (tied weights count once), then the first the files hold and
    the model has no place for. Without safetensors files, the .bin files are read the same way (`bin_weights`).
    """
    try:
        with torch.device("meta"), _without_progress_bars():
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception as error:  # noqa: BLE001 - sizes the bounds let through and transformers still refuses
        reason = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        raise ModelLoadError(f"Model at {model_dir} has a config.json no model can be built from ({reason}).") from None
    state = model.state_dict()
    expected = {name: tuple(tensor.shape) for name, tensor in state.items()}
    files = sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("*.bin"))
    present = set()
    for weights in files:
        for name, shape, floating in _weight_shapes(weights):
            if name in expected and shape != expected[name]:
                raise ModelLoadError(
                    f"Model weights in {weights} do not fit its config.json: {name} has shape "
                    f"{list(shape)}, the config makes it {list(expected[name])}; the weights belong to "
                    "another model."
                )
            if name in expected and state[name].is_floating_point() and not floating:
                raise ModelLoadError(
                    f"Model weights in {weights} hold {name} as integers or booleans, not floating-point numbers; "
                    "the file is damaged or not a model's weights."
                )
            present.add(name)
    if files:
        _check_weight_names(model_dir, model, present)


def _weight_shapes(weights: Path) -> Iterator[tuple[str, tuple[int, ...], bool]]:
    """(name, shape, whether floating-point) of each tensor of a weight file: a safetensors file's header, or a .bin
    file read weights-only and memory-mapped (bin_weights)."""
    if weights.suffix == ".bin":
        for name, tensor in bin_weights(weights).items():
            yield name, tuple(tensor.shape), tensor.is_floating_point()
        return
    try:
        with safe_open(str(weights), framework="pt") as tensors:
            shapes = [
                (name, tuple(tensors.get_slice(name).get_shape()), tensors.get_slice(name).get_dtype() in FLOAT_DTYPES)
                for name in tensors.keys()
            ]
    except (SafetensorError, OSError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ModelLoadError(f"Model weights in {weights} cannot be read ({reason}).") from None
    yield from shapes


def bin_weights(weights: Path) -> dict[str, torch.Tensor]:
    """The tensors of a pytorch_model.bin by name, loaded weights-only (no pickled code runs) and memory-mapped;
    ModelLoadError, one sentence, for a file torch refuses or that holds anything but a dict of tensors."""
    try:
        # torch warns that a plain pickle's protocol is not its default: noise beside the refusal
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            loaded = torch.load(weights, map_location="cpu", mmap=True, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as error:
        raise ModelLoadError(
            f"Model weights in {weights} cannot be loaded safely ({load_failure_reason(error)}); tlt loads only "
            "tensors from a .bin file, so save the weights again (as safetensors, or a state dict of tensors)."
        ) from None
    if not isinstance(loaded, dict):
        raise ModelLoadError(
            f"Model weights in {weights} hold a {type(loaded).__name__}, not a dict of tensors by name; save the "
            "weights again (as safetensors, or a state dict of tensors)."
        )
    for name, value in loaded.items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            raise ModelLoadError(
                f"Model weights in {weights} hold {name!r}: a {type(value).__name__}, not a tensor; save the "
                "weights again (as safetensors, or a state dict of tensors)."
            )
    return loaded


def _check_weight_names(model_dir: Path, model: PreTrainedModel, present: set[str]) -> None:
    """ModelLoadError when the weight files lack a tensor of `model` (tied names: one of them is enough) or hold
    one it has no place for."""
    aliases: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        aliases.setdefault(id(tensor), []).append(name)
    missing = [names[0] for names in aliases.values() if not present.intersection(names)]
    unexpected = sorted(present - {name for names in aliases.values() for name in names})
    if missing or unexpected:
        raise ModelLoadError(weight_names_refusal(model_dir, missing, unexpected))


def weight_names_refusal(model_dir: Path, missing: list[str], unexpected: list[str]) -> str:
    """The one sentence refusing a folder whose weights lack tensors of the model or hold ones it has no place for."""
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        return (
            f"Model weights in {model_dir} lack {missing[0]}{more}, which the model its config.json builds has "
            "(training would start those layers random); the weight files are incomplete, save the model again."
        )
    more = f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else ""
    return (
        f"Model weights in {model_dir} hold {unexpected[0]}{more}, which the model its config.json builds has no "
        "place for; the weights belong to another model or config.json was changed."
    )


def model_fingerprint(model_path: str) -> str:
    """A short hash of the model's config and weight files (name, size, modification time).

    Caches derived from a model (the warmed-up drafter) key on it, so replacing the weights in a
    folder, or a new built-in model, never reuses what was made from the old ones.
    """
    model_dir = model_folder(model_path)
    weights = sorted(path for path in model_dir.iterdir() if path.suffix in WEIGHT_SUFFIXES)
    description = {
        "config": (model_dir / "config.json").read_text(encoding="utf-8"),
        "weights": [(path.name, path.stat().st_size, path.stat().st_mtime_ns) for path in weights],
    }
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:16]


def _checked_model_dir(model_path: str) -> Path:
    model_dir = resolve_model_path(model_path)
    if not model_dir.exists() and model_path.startswith(CACHE_PREFIX):
        raise ModelLoadError(
            f"Model path {model_path} ({model_dir}) does not exist; make it with `python "
            f"scripts/make_real_model.py`, which writes SmolLM2-135M-Instruct to {CACHE_PREFIX}models/"
            "SmolLM2-135M-Instruct, or give a local Hugging Face folder."
        )
    if not model_dir.exists():
        raise ModelLoadError(
            f"Model path {model_dir} does not exist; give a local Hugging Face folder or {BUILTIN_TINY_MODEL!r}."
        )
    if not (model_dir / "config.json").is_file():
        raise ModelLoadError(f"Model path {model_dir} is not a Hugging Face model folder (it has no config.json).")
    return model_dir


def _check_causal_lm_config(model_dir: Path, trust_remote_code: bool) -> PretrainedConfig:
    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as error:  # noqa: BLE001 - the folder's JSON: any failure to read it is the folder's
        reason = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        raise ModelLoadError(f"Model at {model_dir} has a config transformers cannot read ({reason}).") from None
    _check_config_sizes(model_dir, config)
    remote_causal_lm = trust_remote_code and "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING and not remote_causal_lm:
        raise ModelLoadError(
            f"Model at {model_dir} has architecture {config.model_type!r}, which is not a causal language model."
        )
    return config


def _check_config_sizes(model_dir: Path, config: PretrainedConfig) -> None:
    """ModelLoadError naming the first size of CONFIG_SIZE_BOUNDS that is not a whole number in [1, its bound], or
    heads that do not divide the hidden size (without a head_dim) or key/value heads that do not divide the heads."""
    sizes = {}
    for key, bound in CONFIG_SIZE_BOUNDS.items():
        value = getattr(config, key, None)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= bound:
            raise ModelLoadError(
                f"Model at {model_dir} has {key} {value!r} in config.json; it must be a whole number from 1 to {bound}."
            )
        sizes[key] = value
    heads, kv_heads = sizes.get("num_attention_heads"), sizes.get("num_key_value_heads")
    if heads and "hidden_size" in sizes and "head_dim" not in sizes and sizes["hidden_size"] % heads:
        raise ModelLoadError(
            f"Model at {model_dir} has hidden_size {sizes['hidden_size']} in config.json, which its "
            f"num_attention_heads {heads} do not divide."
        )
    if heads and kv_heads and heads % kv_heads:
        raise ModelLoadError(
            f"Model at {model_dir} has num_attention_heads {heads} in config.json, which its num_key_value_heads "
            f"{kv_heads} do not divide."
        )


def _load_tokenizer(model_dir: Path, trust_remote_code: bool) -> PreTrainedTokenizerBase:
    if not any((model_dir / file_name).is_file() for file_name in TOKENIZER_FILES):
        raise ModelLoadError(f"Model folder {model_dir} has no tokenizer; save one there (e.g. tokenizer.json).")
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        reason = str(error).splitlines()[0]
        raise ModelLoadError(f"The tokenizer in {model_dir} cannot be loaded ({reason}).") from None
    if tokenizer.eos_token_id is None:
        raise ModelLoadError(f"The tokenizer in {model_dir} has no EOS token; set eos_token in tokenizer_config.json.")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _load_model(model_dir: Path, dtype: torch.dtype, trust_remote_code: bool) -> PreTrainedModel:
    try:
        with _without_progress_bars():  # tlt shows its own progress; transformers' "Loading weights" is noise
            model, loading_info = AutoModelForCausalLM.from_pretrained(
                model_dir,
                dtype=dtype,
                local_files_only=True,
                trust_remote_code=trust_remote_code,
                output_loading_info=True,
            )
    except (OSError, SafetensorError, RuntimeError) as error:
        # RuntimeError: weights that do not fit the config where no safetensors header showed it (.bin files)
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ModelLoadError(f"Model weights in {model_dir} cannot be loaded ({reason}).") from None
    # transformers fills a missing weight with fresh random values and drops an unexpected one, saying so only in
    # its load report: either means the folder is not the model its config describes
    missing, unexpected = sorted(loading_info["missing_keys"]), sorted(loading_info["unexpected_keys"])
    if missing or unexpected:
        raise ModelLoadError(weight_names_refusal(model_dir, missing, unexpected))
    if not hasattr(model, "get_decoder") or model.get_output_embeddings() is None:
        raise ModelLoadError(
            f"Model at {model_dir} ({type(model).__name__}) lacks get_decoder() or an lm_head, which tlt needs."
        )
    return model.eval()


@contextlib.contextmanager
def _without_progress_bars() -> Iterator[None]:
    shown = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            transformers_logging.enable_progress_bar()
