"""Generation and weight-sync traffic against real fake-SGLang server processes over HTTP."""

from __future__ import annotations

import threading

import pytest
from sglang_fakes import fake_launch

from tlt_cli.engine.sampling import SamplingParams
from tlt_cli.rollout.types import RolloutRequest
from tlt_cli.sglang.client import SGLangClient, completion_from_response, speculative_stats
from tlt_cli.sglang.server import ServerGroup
from tlt_cli.sglang.transport import ServerEndpoint, SGLangRequestError
from tlt_cli.sglang.version import sglang_features
from tlt_cli.sglang.weight_sync import (
    AcceptLengthCollapsed,
    WeightSyncError,
    check_sync_landed,
    probe_accept_length,
    push_target_from_disk,
    send_tensor_update,
    server_version,
)

EOS = 2
FEATURES = sglang_features("0.5.23")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("fake_sglang")
    # server 1 decodes slowly (0.05 s per unit of the first prompt id), so server 0 goes idle first
    launches = [fake_launch(0, log_dir), fake_launch(1, log_dir, "--generate-delay", "0.05")]
    with ServerGroup(launches, startup_timeout_s=20, stop_timeout_s=5) as group:
        yield group


@pytest.fixture()
def fresh_server(tmp_path):
    with ServerGroup(
        [fake_launch(0, tmp_path, "--break-draft-on-update")], startup_timeout_s=20, stop_timeout_s=5
    ) as group:
        yield group.endpoints[0]


def test_generate_shards_requests_and_returns_completions_in_order(servers):
    client = SGLangClient(servers.endpoints, eos_token_id=EOS, request_timeout_s=30)
    requests = [
        RolloutRequest(request_id=100 + index, prompt_ids=(first, 5, 6))
        for index, first in enumerate([4, 3, 6, 5, 8, 7])
    ]
    idle_events = []
    completions = client.generate(
        requests, SamplingParams(max_new_tokens=6), on_server_idle=lambda index, at: idle_events.append((index, at))
    )
    assert [completion.request_id for completion in completions] == [100, 101, 102, 103, 104, 105]
    for completion in completions:
        if completion.prompt_ids[0] % 2 == 0:
            assert completion.finished_by_eos and completion.response_ids == [10, 11, 12, EOS]
        else:
            assert not completion.finished_by_eos and completion.response_ids == [10, 11, 12, 13, 14, 15]
        assert completion.start <= completion.end
        assert completion.speculative.accept_length == 3.0
        # SGLang's output_token_logprobs, one per response token
        expected = [-(index + 1) / 10 for index in range(len(completion.response_ids))]
        assert completion.rollout_logprobs.tolist() == pytest.approx(expected)
    # even-first prompts went to server 0 (positions 0, 2, 4), odd-first to the slow server 1
    assert [index for index, _ in idle_events] == [0, 1]
    assert idle_events[0][1] <= idle_events[1][1]
    assert client.idle_servers() == [0, 1]


def test_outstanding_requests_are_counted_while_in_flight(servers):
    client = SGLangClient(servers.endpoints[1:], eos_token_id=EOS, request_timeout_s=30)
    seen = []
    worker = threading.Thread(
        target=lambda: client.generate(
            [RolloutRequest(1, (19, 1)), RolloutRequest(2, (17, 1))], SamplingParams(max_new_tokens=3)
        ),
    )
    worker.start()
    while worker.is_alive():
        seen.append(client.outstanding_requests(0))
        worker.join(timeout=0.05)
    assert max(seen) == 2 and client.outstanding_requests(0) == 0


def test_wrong_api_key_is_a_clear_error_and_leaves_nothing_outstanding(servers):
    wrong = ServerEndpoint(0, servers.endpoints[0].url, "not-the-key")
    client = SGLangClient([wrong], eos_token_id=EOS, request_timeout_s=10, max_in_flight_per_server=1)
    with pytest.raises(SGLangRequestError, match=r"HTTP 401 \(wrong API key\?\)"):
        client.generate([RolloutRequest(index, (3, 1)) for index in range(4)], SamplingParams(max_new_tokens=3))
    assert client.outstanding_requests(0) == 0


def test_unreachable_server_names_itself():
    client = SGLangClient([ServerEndpoint(3, "http://127.0.0.1:9", "k")], eos_token_id=EOS, request_timeout_s=2)
    with pytest.raises(SGLangRequestError, match=r"SGLang server 3 \(http://127.0.0.1:9/generate\) did not answer"):
        client.generate([RolloutRequest(0, (3,))], SamplingParams(max_new_tokens=2))


def test_sglang_meta_info_maps_onto_speculative_stats():
    # 5 verify passes: one accepted 0 drafts, two accepted 1, two accepted 3 (of depth 3)
    stats = speculative_stats(
        {"spec_verify_ct": 5, "spec_num_correct_drafts": 8, "spec_correct_drafts_histogram": [1, 2, 0, 2]}
    )
    assert stats.accepted_by_depth == [4, 2, 2]
    assert stats.proposed_by_depth == [5, 5, 5]
    assert stats.accept_length == (8 + 5) / 5
    assert speculative_stats({}).verify_passes == 0


def test_logprobs_that_do_not_cover_the_output_are_not_used():
    def completion(meta_info: dict):
        response = {"output_ids": [10, 11], "meta_info": {"finish_reason": {"type": "length"}, **meta_info}}
        return completion_from_response(RolloutRequest(7, (1,)), response, 0.0, 1.0)

    assert completion({"output_token_logprobs": [[-0.5, 10, None], [-0.25, 11, None]]}).rollout_logprobs.tolist() == [
        -0.5,
        -0.25,
    ]
    assert completion({}).rollout_logprobs is None
    assert completion({"output_token_logprobs": [[-0.5, 10, None]]}).rollout_logprobs is None
    assert completion({"output_token_logprobs": [[-0.5, 10, None], [None, 11, None]]}).rollout_logprobs is None


def test_aborted_request_is_an_error():
    response = {"output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "message": "out of memory"}}}
    with pytest.raises(SGLangRequestError, match="aborted request 7: out of memory"):
        completion_from_response(RolloutRequest(7, (1,)), response, 0.0, 1.0)


def test_tensor_update_runs_inside_a_session_and_the_probe_sees_the_new_version(fresh_server):
    assert server_version(fresh_server) == "0.5.23"
    before = probe_accept_length(fresh_server, [(3, 4), (5, 6)], max_new_tokens=7, eos_token_id=EOS)
    assert before.accept_length == 3.0 and before.weight_version == "default"
    send_tensor_update(fresh_server, FEATURES, ["cGF5bG9hZA=="], "target", weight_version="step-1")
    after = probe_accept_length(fresh_server, [(3, 4), (5, 6)], max_new_tokens=7, eos_token_id=EOS)
    check_sync_landed(fresh_server, before, after, "step-1", collapse_accept_length=1.1)
    with pytest.raises(WeightSyncError, match="weight version 'step-1', not 'step-2'"):
        check_sync_landed(fresh_server, before, after, "step-2", collapse_accept_length=1.1)


def test_a_draft_sync_that_breaks_acceptance_is_caught(fresh_server):
    before = probe_accept_length(fresh_server, [(3, 4)], max_new_tokens=7, eos_token_id=EOS)
    send_tensor_update(fresh_server, FEATURES, ["cGF5bG9hZA=="], "draft", weight_version="step-1")
    after = probe_accept_length(fresh_server, [(3, 4)], max_new_tokens=7, eos_token_id=EOS)
    assert after.accept_length == 1.0
    with pytest.raises(AcceptLengthCollapsed, match="fell from 3.00 to 1.00"):
        check_sync_landed(fresh_server, before, after, "step-1", collapse_accept_length=1.1)
    # a drafter that never worked (fresh, untrained) is not reported as a collapse
    check_sync_landed(fresh_server, None, after, "step-1", collapse_accept_length=1.1)


def test_old_sglang_cannot_take_draft_weights_and_a_bare_update_is_refused_by_new_servers(fresh_server):
    with pytest.raises(WeightSyncError, match="cannot update the draft model alone"):
        send_tensor_update(fresh_server, sglang_features("0.5.20"), ["eA=="], "draft", weight_version="v")
    # the 0.5.20 form (no session) is what a 0.5.21+ server refuses, as the real one does
    with pytest.raises(SGLangRequestError, match="must run between begin and end"):
        send_tensor_update(fresh_server, sglang_features("0.5.20"), ["eA=="], "target", weight_version="v")


def test_disk_update_sets_the_weight_version(fresh_server, tmp_path):
    push_target_from_disk(fresh_server, tmp_path, weight_version="step-3")
    assert probe_accept_length(fresh_server, [(3, 4)], max_new_tokens=4, eos_token_id=EOS).weight_version == "step-3"


def test_sampling_body_speaks_sglang():
    from tlt_cli.sglang.client import sampling_body

    body = sampling_body(
        SamplingParams(max_new_tokens=9, temperature=0.7, top_p=0.9, top_k=0), eos_token_id=EOS, seed=11
    )
    assert body == {
        "max_new_tokens": 9,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,
        "stop_token_ids": [EOS],
        "sampling_seed": 11,
    }
    assert sampling_body(SamplingParams(max_new_tokens=1, top_k=5), EOS, None)["top_k"] == 5
