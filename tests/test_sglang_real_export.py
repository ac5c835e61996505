"""`tlt export-drafter`'s folder loaded by SGLang 0.5.23's own EAGLE draft classes on CPU.

SGLang's `Qwen2ForCausalLMEagle` / `LlamaForCausalLMEagle` are built in the SGLang side environment
(tests/sglang_real_draft_probe.py) and fed the export through their own `load_weights`: every parameter must
be written (filled with NaN before), and each must hold, value for value, what tlt's own modules hold (the
drafter's fc and decoder layer, the target's shared embedding; read from them, not from the exported file, so a
tensor exported under the wrong name or in the wrong order fails too), fused q/k/v and gate/up compared slice by
slice with tlt's q_proj, k_proj, v_proj, gate_proj, up_proj. The token map of a reduced draft vocabulary must
read back through SGLang's `load_token_map`, and the draft layer's output on the same embeddings and target
hidden states must equal tlt's drafter's (before the final norm tlt applies and SGLang does not, docs/gpu.md
"Known difference of the drafter"). That output is one position's, where attention returns its value: it reads
fc, v_proj, o_proj and the MLP, not q_proj and k_proj, which only the value comparison checks.

Run: `pytest -m real_sglang tests/test_sglang_real_export.py` after scripts/build_sglang_cpu_env.py.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from sglang_real import SIDE_PYTHON, requires_real_sglang
from test_export import partly_right_drafter, tiny_target, write_recipe

from tlt_cli.drafter.model import EagleDrafter, save_drafter
from tlt_cli.drafter.vocabulary import DraftVocabulary
from tlt_cli.export import export_drafter
from tlt_cli.models.tiny import save_model_folder
from tlt_cli.sglang.server_args import CPU_SERVER_ENVIRONMENT

pytestmark = [pytest.mark.real_sglang, pytest.mark.slow, requires_real_sglang]

PROBE = Path(__file__).resolve().parent / "sglang_real_draft_probe.py"
# sglang.srt.layers.vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE
VOCAB_PADDING = 64


def run_probe(export_dir: Path, inputs: dict[str, torch.Tensor], work: Path, token_map: Path | None = None):
    """(SGLang's report, its layer output, its parameters' values) for `export_dir` on `inputs`."""
    save_file(inputs, str(work / "inputs.safetensors"))
    command = [str(SIDE_PYTHON), str(PROBE), str(export_dir), str(work / "inputs.safetensors"), str(work / "sg.json")]
    if token_map is not None:
        command.append(str(token_map))
    environment = {**os.environ, **CPU_SERVER_ENVIRONMENT, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=environment)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((work / "sg.json").read_text())
    values = load_file(str(work / "sg-parameters.safetensors"))
    return report, load_file(str(work / "sg.safetensors"))["layer_output"], values


def tlt_tensors(drafter: EagleDrafter, target, include_shared: bool) -> dict[str, torch.Tensor]:
    """What each exported name must hold, read from tlt's own modules: the drafter's fc (its bias zero: tlt's fc has
    none) and decoder layer (SGLang's layers.0), and with include_shared the target's embedding (and untied head)."""
    tensors = {
        name.replace("decoder_layer.", "layers.0.", 1): tensor.detach()
        for name, tensor in drafter.state_dict().items()
        if name.startswith(("fc.", "decoder_layer."))
    }
    tensors.setdefault("fc.bias", torch.zeros(drafter.fc.weight.shape[0]))
    if include_shared:
        tensors["embed_tokens.weight"] = target.get_input_embeddings().weight.detach()
        if not target.config.tie_word_embeddings:
            tensors["lm_head.weight"] = target.get_output_embeddings().weight.detach()
    return tensors


def expected_slices(name: str, tensors: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The tensors SGLang's parameter `name` must hold, in the order of its rows: one, or the parts of a fused q/k/v
    or gate/up parameter."""
    name = name.removeprefix("model.")
    for fused, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))):
        if fused in name:
            return [(name.replace(fused, part), tensors[name.replace(fused, part)]) for part in parts]
    return [(name, tensors[name])]


@pytest.mark.parametrize("architecture", ["qwen2", "llama"])
@pytest.mark.parametrize("include_shared", [False, True])
def test_sglang_eagle_class_consumes_every_exported_tensor_and_drafts_like_tlt(tmp_path, architecture, include_shared):
    target, tokenizer = tiny_target(architecture)
    save_model_folder(target, tokenizer, tmp_path / "model")
    drafter = partly_right_drafter(target)
    save_drafter(drafter, tmp_path / "drafter")
    recipe = write_recipe(tmp_path / "recipe.yaml", tmp_path / "model")
    out = tmp_path / "out"
    export_drafter(tmp_path / "drafter", out, recipe_path=recipe, include_shared=include_shared, prompts=1)
    exported = load_file(str(out / "model.safetensors"))
    expected_tensors = tlt_tensors(drafter, target, include_shared)
    assert exported.keys() == expected_tensors.keys()

    generator = torch.Generator().manual_seed(0)
    token_ids = torch.randint(0, target.config.vocab_size, (4,), generator=generator)
    target_hidden = torch.randn(4, target.config.hidden_size, generator=generator)
    embeds = target.get_input_embeddings().weight[token_ids].detach()
    report, sglang_output, values = run_probe(out, {"embeds": embeds, "target_hidden": target_hidden}, tmp_path)

    assert report["class"] == {"qwen2": "Qwen2ForCausalLMEagle", "llama": "LlamaForCausalLMEagle"}[architecture]
    parameters = report["parameters"]
    shared = {"model.embed_tokens.weight", "lm_head.weight"}
    unwritten = {name for name, seen in parameters.items() if not seen["written"]}
    # the shared embedding and an untied head come from the target at serve time (eagle_worker_v2.init_lm_head);
    # an exported embedding is loaded, an exported lm_head.weight never is: the EAGLE classes' load_weights skip
    # every name with "lm_head" in it
    assert unwritten == ({"lm_head.weight"} & set(parameters) if include_shared else shared & set(parameters))
    for name, seen in parameters.items():
        if name in unwritten:
            continue
        slices = expected_slices(name, expected_tensors)
        expected = [sum(len(tensor) for _, tensor in slices), *slices[0][1].shape[1:]]
        if name in shared:
            # SGLang pads the vocabulary rows of its (vocab-parallel) embedding and head to a multiple of 64
            expected[0] = -(-expected[0] // VOCAB_PADDING) * VOCAB_PADDING
        assert seen["shape"] == expected, name
        first_row = 0
        for part, tensor in slices:
            held = values[name][first_row : first_row + len(tensor)]
            assert torch.equal(held, tensor.to(held.dtype)), f"SGLang's {name} rows from {first_row} are not {part}"
            first_row += len(tensor)
    # each exported tensor has a parameter of SGLang's that holds it (directly or as a slice of a fused one)
    sglang_names = {name.removeprefix("model.") for name in parameters}
    fused = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj"}
    fused["up_proj"] = "gate_up_proj"
    for name in exported:
        mapped = next((name.replace(part, whole) for part, whole in fused.items() if f".{part}." in name), name)
        assert mapped in sglang_names, f"exported {name} has no place in SGLang's {report['class']}"

    # one position each: tlt's drafter from the same inputs, compared before the final norm
    with torch.no_grad():
        tlt_hidden = drafter(token_ids.view(4, 1), target_hidden.view(4, 1, -1), torch.zeros(4, 1, dtype=torch.long))
    final_norm = target.model.norm
    with torch.no_grad():
        assert torch.allclose(final_norm(sglang_output), tlt_hidden.hidden.view(4, -1), atol=1e-5)


def test_the_token_map_of_a_reduced_vocabulary_reads_back_through_sglang(tmp_path):
    target, tokenizer = tiny_target()
    save_model_folder(target, tokenizer, tmp_path / "model")
    kept = torch.arange(0, target.config.vocab_size, 4)
    save_drafter(
        EagleDrafter(target, seed=1, vocabulary=DraftVocabulary(kept, target.config.vocab_size)), tmp_path / "drafter"
    )
    recipe = write_recipe(tmp_path / "recipe.yaml", tmp_path / "model")
    out = tmp_path / "out"
    export_drafter(tmp_path / "drafter", out, recipe_path=recipe, prompts=1)
    token_map = out / "token_map.pt"
    assert token_map.is_file() and f"--speculative-token-map {token_map}" in (out / "README.md").read_text()
    inputs = {"embeds": torch.zeros(1, 32), "target_hidden": torch.zeros(1, 32)}
    report, _, _ = run_probe(out, inputs, tmp_path, token_map)
    assert report["token_map"] == kept.tolist()
