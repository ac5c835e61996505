"""Rollout generation on SGLang servers over HTTP, with per-request timings and per-server idleness.

`SGLangClient(endpoints, eos_token_id, request_timeout_s).generate(requests, params)` shards the
requests over the servers (request k of the list goes to server k mod n, like the embedded
engine's worker shards), sends each as its own `/generate` call of token ids so SGLang batches
them continuously, and returns the shared `Completion`s in input order. `start` / `end` are the
wall-clock times the request was sent and its answer arrived (so they include time queued in the
server). Speculative statistics come from SGLang's per-request `meta_info`, and so do the sampled tokens'
log-probs (`return_logprob`; the servers run with SGLANG_RETURN_ORIGINAL_LOGPROB, tlt_cli/sglang/server_args.py,
so they are log_softmax(logits)[token] before temperature, as tlt's learner defines them).

Idle detection uses only our own bookkeeping: a server is idle when none of the requests tlt sent
it is outstanding. `on_server_idle(server_index, time)` fires once per server per rollout when its
shard is done, from a client thread; `outstanding_requests(i)` can be polled any time.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from tlt_cli.engine.sampling import SamplingParams
from tlt_cli.rollout.types import Completion, RolloutRequest
from tlt_cli.sglang.transport import ServerEndpoint, SGLangRequestError, post_json
from tlt_cli.speculative.types import SpeculativeStats

# SGLang's sampling_params spells "keep every token" as top_k -1; tlt spells it 0
SGLANG_TOP_K_ALL = -1


def sampling_body(params: SamplingParams, eos_token_id: int, seed: int | None) -> dict:
    """SGLang `sampling_params` for tlt's SamplingParams; EOS is a stop token that stays in the output."""
    body = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else SGLANG_TOP_K_ALL,
        "stop_token_ids": [eos_token_id],
    }
    if seed is not None:
        body["sampling_seed"] = seed
    return body


def speculative_stats(meta_info: dict) -> SpeculativeStats:
    """SpeculativeStats from SGLang's meta_info (all zero when the request ran without SD).

    spec_verify_ct = verify passes; spec_num_correct_drafts = accepted draft tokens;
    spec_correct_drafts_histogram[k] = verify passes that accepted exactly k drafts, so depth d
    was accepted by every pass with k > d. proposed_by_depth counts every pass at each depth the
    histogram spans (SGLang does not report the depth each pass drafted).
    """
    verify_passes = int(meta_info.get("spec_verify_ct", 0))
    if verify_passes == 0:
        return SpeculativeStats()
    histogram = [int(count) for count in meta_info.get("spec_correct_drafts_histogram") or []]
    depths = max(len(histogram) - 1, 0)
    # passes that accepted more than d drafts accepted the draft at depth d
    accepted_by_depth = [sum(histogram[depth + 1 :]) for depth in range(depths)]
    return SpeculativeStats(
        verify_passes=verify_passes,
        accepted_draft_tokens=int(meta_info.get("spec_num_correct_drafts", 0)),
        accepted_by_depth=accepted_by_depth,
        proposed_by_depth=[verify_passes] * depths,
    )


def output_logprobs(meta_info: dict, output_ids: list[int]) -> torch.Tensor | None:
    """[R] float32 log-probs of the output tokens from meta_info's output_token_logprobs ([logprob, token id,
    text] per token), or None when the server gave none or they do not cover exactly the output ids."""
    entries = meta_info.get("output_token_logprobs") or []
    if [int(entry[1]) for entry in entries] != output_ids or any(entry[0] is None for entry in entries):
        return None
    return torch.tensor([float(entry[0]) for entry in entries], dtype=torch.float32) if entries else None


def completion_from_response(request: RolloutRequest, response: dict, start: float, end: float) -> Completion:
    """A Completion from one /generate answer; SGLangRequestError if the server aborted the request."""
    meta_info = response.get("meta_info", {})
    finish_reason = meta_info.get("finish_reason") or {}
    if finish_reason.get("type") == "abort":
        raise SGLangRequestError(
            f"SGLang aborted request {request.request_id}: {finish_reason.get('message', 'no reason given')}."
        )
    output_ids = [int(token) for token in response["output_ids"]]
    return Completion(
        request_id=request.request_id,
        prompt_ids=request.prompt_ids,
        response_ids=output_ids,
        # "stop" = a stop token matched (SGLang keeps it as the last output id); "length" = max_new_tokens
        finished_by_eos=finish_reason.get("type") == "stop",
        start=start,
        end=end,
        speculative=speculative_stats(meta_info),
        rollout_logprobs=output_logprobs(meta_info, output_ids),
    )


class SGLangClient:
    """Sends rollout requests to SGLang servers and tracks what each server still owes us.

    Example:
        client = SGLangClient(group.endpoints, eos_token_id=tokenizer.eos_token_id, request_timeout_s=3600)
        completions = client.generate(requests, SamplingParams(max_new_tokens=512), on_server_idle=notify)
    """

    def __init__(
        self,
        endpoints: Sequence[ServerEndpoint],
        eos_token_id: int,
        request_timeout_s: float,
        max_in_flight_per_server: int = 1024,
    ):
        if not endpoints:
            raise ValueError("SGLangClient needs at least one server endpoint.")
        self.endpoints = list(endpoints)
        self.eos_token_id = eos_token_id
        self.request_timeout_s = request_timeout_s
        self.max_in_flight_per_server = max_in_flight_per_server
        self._outstanding = [0] * len(self.endpoints)
        self._lock = threading.Lock()

    def outstanding_requests(self, server_index: int) -> int:
        """Requests tlt sent to server `server_index` that have not come back yet."""
        with self._lock:
            return self._outstanding[server_index]

    def idle_servers(self) -> list[int]:
        """Indices of servers with no outstanding request from tlt."""
        with self._lock:
            return [index for index, count in enumerate(self._outstanding) if count == 0]

    def generate(
        self,
        requests: Sequence[RolloutRequest],
        params: SamplingParams,
        on_server_idle: Callable[[int, float], None] | None = None,
        seed: int | None = None,
    ) -> list[Completion]:
        """Generate every request; `seed` (if given) seeds request r with seed + r.request_id."""
        rollout_id = uuid.uuid4().hex[:12]
        shards = [list(requests[index :: len(self.endpoints)]) for index in range(len(self.endpoints))]
        with self._lock:
            for server_index, shard in enumerate(shards):
                self._outstanding[server_index] += len(shard)
        executors = [
            ThreadPoolExecutor(max_workers=max(1, min(len(shard), self.max_in_flight_per_server))) for shard in shards
        ]
        # position in `requests` -> (server, future); request k went to server k mod n
        submitted: dict[int, tuple[int, Future]] = {}
        try:
            for server_index, shard in enumerate(shards):
                for offset, request in enumerate(shard):
                    position = server_index + offset * len(self.endpoints)
                    request_seed = None if seed is None else seed + request.request_id
                    future = executors[server_index].submit(
                        self._generate_one,
                        server_index,
                        request,
                        params,
                        request_seed,
                        f"tlt-{rollout_id}-{position}",
                        on_server_idle,
                    )
                    submitted[position] = (server_index, future)
            return [submitted[position][1].result() for position in range(len(requests))]
        finally:
            for executor in executors:
                executor.shutdown(wait=True, cancel_futures=True)
            self._forget_unsent(shards, submitted.values())

    def _forget_unsent(self, shards: list[list[RolloutRequest]], submitted: Iterable[tuple[int, Future]]) -> None:
        """Requests cancelled (or never submitted) after another one failed were never sent: not outstanding."""
        unsent = [len(shard) for shard in shards]
        for server_index, future in submitted:
            if not future.cancelled():
                unsent[server_index] -= 1
        with self._lock:
            for server_index, count in enumerate(unsent):
                self._outstanding[server_index] -= count

    def _generate_one(
        self,
        server_index: int,
        request: RolloutRequest,
        params: SamplingParams,
        seed: int | None,
        sglang_request_id: str,
        on_server_idle: Callable[[int, float], None] | None,
    ) -> Completion:
        body = {
            "input_ids": list(request.prompt_ids),
            "sampling_params": sampling_body(params, self.eos_token_id, seed),
            "rid": sglang_request_id,
            "stream": False,
            # the sampled tokens' log-probs only (logprob_start_len -1: none of the prompt's)
            "return_logprob": True,
            "logprob_start_len": -1,
        }
        start = time.time()
        try:
            response = post_json(self.endpoints[server_index], "/generate", body, self.request_timeout_s)
            end = time.time()
            return completion_from_response(request, response, start, end)
        finally:
            self._finish(server_index, on_server_idle)

    def _finish(self, server_index: int, on_server_idle: Callable[[int, float], None] | None) -> None:
        with self._lock:
            self._outstanding[server_index] -= 1
            now_idle = self._outstanding[server_index] == 0
        if now_idle and on_server_idle is not None:
            on_server_idle(server_index, time.time())
