"""tlt's SGLang backend against a real SGLang 0.5.23 server on CPU: generation, the API key, the logs, weight
pushes after a real DeepSpeed update, a server dying mid-rollout, and nothing of the server left after stop
(processes, /dev/shm entries, temporary files).

Run: `pytest -m real_sglang tests/test_sglang_real.py` after scripts/build_sglang_cpu_env.py (skipped, with
the reason, without its environment). One server of the shipped tiny Qwen2 (float32) serves the module; it is
started and stopped by tlt's own launcher (tlt_cli/sglang/server.py).
"""

from __future__ import annotations

import copy
import os
import signal
import stat
import threading
import time

import psutil
import pytest
import torch
from sglang_real import (
    RunWatch,
    copy_tiny_model,
    requires_real_sglang,
    sglang_processes,
    sglang_shared_memory,
    start_cpu_server,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

from tlt_cli.config import ActorConfig
from tlt_cli.engine.sampling import SamplingParams
from tlt_cli.rollout.generate_loop import EmbeddedEngine
from tlt_cli.rollout.types import Completion, RolloutRequest
from tlt_cli.sglang.client import SGLangClient
from tlt_cli.sglang.server import live_group_members
from tlt_cli.sglang.transport import ServerEndpoint, SGLangRequestError, post_json
from tlt_cli.sglang.version import sglang_features
from tlt_cli.sglang.weight_sync import (
    push_target_from_disk,
    push_tensors,
    target_tensors,
    write_checkpoint,
)
from tlt_cli.training.actor import Actor
from tlt_cli.training.policy_batch import build_policy_batch

pytestmark = [pytest.mark.real_sglang, pytest.mark.slow, requires_real_sglang]

PROMPTS = [(1, 5, 6, 7, 8, 9), (1, 10, 11, 3), (1, 20, 21, 22, 23, 24, 25, 26), (1, 30)]
GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0)
EOS = 2


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(model folder, running ServerGroup) of one real SGLang server with its tokenizer loaded; once stopped, none
    of its processes, /dev/shm entries or temporary files may be left."""
    root = tmp_path_factory.mktemp("real-sglang")
    model_dir = copy_tiny_model(root / "model")
    group = start_cpu_server(model_dir, root / "run")
    folder = group.temporary_folders[0]
    # SGLang's Unix sockets (and its empty temporary files) are made in the server's own folder
    assert len([path for path in folder.iterdir() if stat.S_ISSOCK(path.lstat().st_mode)]) == 3, list(folder.iterdir())
    with RunWatch(lambda: [psutil.Process(group.pids[0])]) as watch:
        watch.look()  # at once: the server holds its entries from start-up to exit
        yield model_dir, group
        group.stop()
    assert not any(live_group_members(pid) for pid in group.pids), "an SGLang process outlived stop()"
    assert sglang_processes(watch.process_names()) and not watch.survivors(), "an SGLang process outlived stop()"
    assert sglang_shared_memory(watch.seen_names()), watch.seen_names()
    assert not watch.left_shared_memory(), "SGLang's /dev/shm entries outlived stop()"
    assert not folder.exists(), "the server's temporary folder outlived stop()"


def load_policy(model_dir) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def transformers_greedy(model, prompt, max_new_tokens) -> list[int]:
    with torch.no_grad():
        output = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=EOS, pad_token_id=0
        )
    return output[0, len(prompt) :].tolist()


def sglang_greedy(endpoint: ServerEndpoint) -> list[list[int]]:
    client = SGLangClient([endpoint], eos_token_id=EOS, request_timeout_s=120)
    requests = [RolloutRequest(request_id=index, prompt_ids=prompt) for index, prompt in enumerate(PROMPTS)]
    return [completion.response_ids for completion in client.generate(requests, GREEDY)]


def test_greedy_sglang_equals_tlt_engine_equals_transformers(served):
    model_dir, group = served
    policy = load_policy(model_dir)
    expected = [transformers_greedy(policy, prompt, GREEDY.max_new_tokens) for prompt in PROMPTS]
    engine = EmbeddedEngine(policy, eos_token_id=EOS, pad_token_id=0)
    requests = [RolloutRequest(request_id=index, prompt_ids=prompt) for index, prompt in enumerate(PROMPTS)]
    tlt = [completion.response_ids for completion in engine.generate(requests, GREEDY, torch.Generator())]
    assert sglang_greedy(group.endpoints[0]) == tlt == expected


def test_text_sglang_returns_is_the_text_tlt_rewards(served):
    """The reward reads tlt's decode of the response ids; SGLang's own `text` of the same answer must match."""
    model_dir, group = served
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    endpoint = group.endpoints[0]
    for prompt in PROMPTS:
        body = {"input_ids": list(prompt), "sampling_params": {"max_new_tokens": 16, "temperature": 0.0}}
        answer = post_json(endpoint, "/generate", body, 60)
        ids = answer["output_ids"]
        assert answer["text"] == tokenizer.decode(ids, skip_special_tokens=True), (prompt, ids)


def test_api_key_file_and_server_log(served):
    _, group = served
    launch = group.launches[0]
    key_file = launch.log_path.parent / "api_key.yaml"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(launch.log_path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(launch.log_path.stat().st_mode) == 0o600
    assert launch.endpoint.api_key not in " ".join(launch.command)
    wrong = ServerEndpoint(index=0, url=launch.endpoint.url, api_key="not-the-key")
    with pytest.raises(SGLangRequestError, match="HTTP 401 \\(wrong API key\\?\\)"):
        post_json(wrong, "/generate", {"input_ids": [1, 5], "sampling_params": {"max_new_tokens": 2}}, 30)
    log = launch.log_path.read_text()
    assert "# tlt: starting SGLang server 0" in log and "POST /generate" in log and "fired up" in log


def deepspeed_update(policy) -> None:
    """One real GRPO update of `policy` by tlt's DeepSpeed actor (ZeRO 2, one gloo rank)."""
    actor = Actor(
        policy, ActorConfig(precision="fp32", lr=5e-2, micro_batch_size=4, zero_stage=2), sequences_per_update=4
    )
    completions = [
        Completion(
            request_id=index,
            prompt_ids=prompt,
            response_ids=[40 + index, 41, EOS],
            finished_by_eos=True,
            start=0.0,
            end=1.0,
        )
        for index, prompt in enumerate(PROMPTS)
    ]
    batch = build_policy_batch(completions, torch.tensor([1.0, -1.0, 1.0, -1.0]), pad_token_id=0)
    actor.update(actor.logprobs(batch))


@pytest.mark.parametrize("route", ["tensor", "disk"])
def test_after_a_deepspeed_update_the_server_answers_as_the_updated_policy(
    served, route, tmp_path, single_process_group
):
    model_dir, group = served
    endpoint = group.endpoints[0]
    policy = load_policy(model_dir)
    before = copy.deepcopy(policy.state_dict())
    deepspeed_update(policy)
    assert all(not torch.equal(value, policy.state_dict()[name]) for name, value in before.items())
    tensors = target_tensors(policy.named_parameters(), bool(policy.config.tie_word_embeddings))
    version = f"{route}-1"
    if route == "tensor":
        push_tensors(endpoint, sglang_features("0.5.23"), tensors, "target", tp_size=1, weight_version=version)
    else:
        push_target_from_disk(endpoint, write_checkpoint(tensors, tmp_path / "weights"), version)
    policy.eval()
    expected = [transformers_greedy(policy, prompt, GREEDY.max_new_tokens) for prompt in PROMPTS]
    original = [transformers_greedy(load_policy(model_dir), prompt, GREEDY.max_new_tokens) for prompt in PROMPTS]
    assert expected != original, "the update did not change greedy output: the test could not tell"
    assert sglang_greedy(endpoint) == expected
    answer = post_json(endpoint, "/generate", {"input_ids": [1, 5], "sampling_params": {"max_new_tokens": 2}}, 30)
    assert answer["meta_info"]["weight_version"] == version
    # back to the served model's own weights for the tests after this one
    push_target_from_disk(endpoint, model_dir, "original")


def test_a_server_dying_mid_rollout_fails_the_rollout_in_one_sentence(served):
    """Runs last: it kills the module's server."""
    _, group = served
    client = SGLangClient(group.endpoints, eos_token_id=EOS, request_timeout_s=60)
    requests = [RolloutRequest(request_id=index, prompt_ids=(1, 5 + index % 50, 6)) for index in range(64)]
    long = SamplingParams(max_new_tokens=1000, temperature=1.0)
    log = group.launches[0].log_path
    prefills_before = log.read_text().count("Prefill batch")

    def kill_soon() -> None:
        # as soon as the server has taken the rollout's first requests
        deadline = time.time() + 60
        while log.read_text().count("Prefill batch") == prefills_before and time.time() < deadline:
            time.sleep(0.02)
        os.killpg(group.pids[0], signal.SIGKILL)

    killer = threading.Thread(target=kill_soon)
    killer.start()
    with pytest.raises(SGLangRequestError, match="SGLang server 0 .*/generate"):
        client.generate(requests, long)
    killer.join()
    assert client.outstanding_requests(0) == 0
