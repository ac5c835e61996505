"""Run by tests/test_sglang_real_export.py in the SGLang side environment (not by tlt's own Python): builds SGLang
0.5.23's own EAGLE draft class for an exported folder on CPU, feeds it the folder's tensors through the class's
own `load_weights`, and writes what it got to a JSON file.

    <side python> tests/sglang_real_draft_probe.py EXPORT_DIR INPUTS.safetensors OUT.json [TOKEN_MAP]

Written: every parameter of the draft model (name, shape, whether load_weights wrote it: parameters are
filled with NaN first) to OUT.json, with the token map as SGLang's `load_token_map` reads it; every
parameter's values to OUT-parameters.safetensors; and the draft layer's output for INPUTS (token embeddings
and target hidden states at one position each) to OUT.safetensors, computed with the loaded model's own
modules: fc, qkv_proj (attention over one position is its value), o_proj, post_attention_layernorm, mlp.
The attention kernel itself (RadixAttention) needs a ForwardBatch and a KV pool, so it is the one step not
run here.
"""

import json
import socket
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from sglang.test.layer_ut_utils import init_single_process_dist
from transformers import AutoConfig


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main(export_dir: Path, inputs_path: Path, out_path: Path, token_map: str | None) -> None:
    init_single_process_dist(master_port=free_port())
    from sglang.srt.models.llama_eagle import LlamaForCausalLMEagle
    from sglang.srt.models.qwen2_eagle import Qwen2ForCausalLMEagle

    classes = {"LlamaForCausalLMEagle": LlamaForCausalLMEagle, "Qwen2ForCausalLMEagle": Qwen2ForCausalLMEagle}
    config = AutoConfig.from_pretrained(export_dir)
    torch.set_default_dtype(torch.float32)
    model = classes[config.architectures[0]](config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(float("nan"))
    tensors = load_file(str(export_dir / "model.safetensors"))
    model.load_weights(list(tensors.items()))
    report = {
        "class": type(model).__name__,
        "parameters": {
            name: {"shape": list(parameter.shape), "written": not bool(parameter.isnan().any())}
            for name, parameter in model.named_parameters()
        },
    }
    if token_map is not None:
        from sglang.srt.speculative.spec_utils import load_token_map

        report["token_map"] = load_token_map(token_map).tolist()
    inputs = load_file(str(inputs_path))
    layer = model.model.layers[0]
    with torch.no_grad():
        hidden = model.model.fc(torch.cat((inputs["embeds"], inputs["target_hidden"]), dim=-1))
        qkv, _ = layer.self_attn.qkv_proj(hidden)
        q_size, kv_size = layer.self_attn.q_size, layer.self_attn.kv_size
        value = qkv[:, q_size + kv_size :]
        # grouped-query attention over a single position: every query head reads its group's value
        heads_per_group = layer.self_attn.num_heads // layer.self_attn.num_kv_heads
        value = value.view(-1, layer.self_attn.num_kv_heads, 1, layer.self_attn.head_dim)
        attention = value.expand(-1, -1, heads_per_group, -1).reshape(value.shape[0], -1)
        attention, _ = layer.self_attn.o_proj(attention)
        hidden = hidden + attention
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    save_file({"layer_output": hidden.contiguous()}, str(out_path.with_suffix(".safetensors")))
    values = {name: parameter.detach().contiguous() for name, parameter in model.named_parameters()}
    save_file(values, str(out_path.with_name(f"{out_path.stem}-parameters.safetensors")))
    out_path.write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else None)
