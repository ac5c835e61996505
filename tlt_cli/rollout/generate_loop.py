"""The generate loop of the embedded rollout: batched generation in-process, on the actor's own module.

The trainer calls `EmbeddedEngine(model, eos_token_id, pad_token_id).generate(requests, sampling,
generator)`. All requests enter one running batch; each step feeds every running row one token
(or, with a `speculative` decoder, a verified draft block) through the model with a per-row
slot cache, explicit position ids and a 4D mask, so rows of different lengths share a forward
without padding. The model is seen only through its `DecodeModel` (tlt_cli/engine/interface.py): the
owned Llama-family forward, or transformers' public API for other families (`decode_model_for`).
A request leaves the batch as soon as it ends (EOS or max_new_tokens): its row is dropped from the
cache and every per-row tensor, so no compute is spent on it afterwards. Asked for (`logprob_temperature`),
its tokens' log-probs under the decode model are computed then, once, from the target hidden states the
cache kept for every position (tlt_cli/engine/logprobs.py), whichever path produced the tokens.
Generation runs under torch.no_grad with the model in eval mode and restores every module's mode
afterwards. Same requests, parameters and generator state give the same output.

Example:
    engine = EmbeddedEngine(policy, eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    completions = engine.generate(requests, SamplingParams(max_new_tokens=64), torch.Generator().manual_seed(0))
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from tlt_cli.engine import decode_model_for
from tlt_cli.engine.interface import DecodeModel
from tlt_cli.engine.logprobs import decoded_logprobs
from tlt_cli.engine.running_batch import DecodeTarget, RunningBatch
from tlt_cli.engine.sampling import SamplingParams, next_tokens
from tlt_cli.rollout.types import Completion, RolloutRequest
from tlt_cli.speculative.types import DecodeStep, SpeculativeStats

if TYPE_CHECKING:
    from tlt_cli.engine.linear_forms import LinearFormPlan
    from tlt_cli.speculative.decoder import SpeculativeDecoder

# slots reserved past the longest prompt when the cache is first allocated (it grows by doubling)
INITIAL_SLACK = 64


@dataclass
class _GenerateCall:
    """What one generate call was asked for, and the Completions it has produced so far."""

    requests: list[RolloutRequest]
    sampling: SamplingParams
    generator: torch.Generator
    on_request_finished: Callable[[Completion], None] | None
    return_hidden: bool
    # None: no log-probs; else each completion's rollout_logprobs at this temperature
    logprob_temperature: float | None
    start: float
    on_decode_step: Callable[[DecodeStep], None] | None
    completions: dict[int, Completion] = field(default_factory=dict)


class EmbeddedEngine:
    """Batched generation with a KV cache, ragged prompts, early exit of finished requests and,
    when given a speculative decoder (`tlt_cli.speculative.decoder.SpeculativeDecoder`), lossless
    speculative decoding. With `linear_plan` (tlt_cli/engine/linear_forms.py), the target's decode model
    computes its products in the measured forms, and so does the drafter, through a decode-time copy
    (`SpeculativeDecoder.use_linear_plan`). `dtype`: the precision the target is decoded in (None: the model's
    own; tlt_cli/tuning/precision.py chooses it), its cache included; speculative decoding is exact against the
    model in that precision. `decode_model`: the model as the engine decodes it (default:
    `decode_model_for(model, dtype)` with `linear_plan`); call its `refresh()` after the model's weights change.
    `stochastic_rounding`: bfloat16 copies of float32 weights follow small updates (tlt_cli/engine/rounding.py)."""

    def __init__(
        self,
        model: nn.Module,
        eos_token_id: int,
        pad_token_id: int,
        speculative: SpeculativeDecoder | None = None,
        linear_plan: LinearFormPlan | None = None,
        decode_model: DecodeModel | None = None,
        dtype: torch.dtype | None = None,
        stochastic_rounding: bool = True,
    ) -> None:
        self.model = model
        if decode_model is None:
            decode_model = decode_model_for(model, dtype, linear_plan, stochastic_rounding)
        self.decode_model = decode_model
        self.target = DecodeTarget(self.decode_model, next(model.parameters()).device)
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.speculative = speculative
        if speculative is not None and linear_plan is not None:
            speculative.use_linear_plan(linear_plan)
        self.device = next(model.parameters()).device

    def generate(
        self,
        requests: Sequence[RolloutRequest],
        sampling: SamplingParams,
        generator: torch.Generator,
        on_request_finished: Callable[[Completion], None] | None = None,
        return_hidden: bool = False,
        on_decode_step: Callable[[DecodeStep], None] | None = None,
        logprob_temperature: float | None = None,
    ) -> list[Completion]:
        """Complete every request; Completions come back in request order.

        generator: drives every random draw (on the model's device); the same state gives the
        same completions.

        return_hidden: also return each completion's `target_hidden` [R, H], the target's last
        hidden state at the position that produced each response token (lm_head(target_hidden[i])
        are the logits of response token i).

        on_decode_step: called after every decode step (not the prefill) with its DecodeStep (so is
        the speculative decoder's `observe_step`, if it has one: the adaptive schedule learns from it).

        logprob_temperature: also return each completion's `rollout_logprobs` [R], log_softmax(logits /
        logprob_temperature)[token] under the decode model (the learner's definition: 1.0 for tlt's own
        GRPO loss, the sampling temperature for TRL's), computed once per finished request from the hidden
        states that produced its tokens, whichever path (plain or speculative) produced them.
        """
        _check_inputs(requests, sampling)
        if not requests:
            return []
        # the decoder's own observer (the adaptive schedule) and the caller's see the same timed steps
        observe_step = self.speculative.observe_step if self.speculative is not None else None
        call = _GenerateCall(
            list(requests),
            sampling,
            generator,
            on_request_finished,
            return_hidden,
            logprob_temperature,
            time.time(),
            _step_observer(observe_step, on_decode_step),
        )
        drafter = self.speculative.drafter if self.speculative is not None else None
        self.decode_model.refresh_if_changed()
        with torch.no_grad(), _eval_mode(self.model), _eval_mode(drafter):
            self._run(call)
        return [call.completions[index] for index in range(len(requests))]

    def _run(self, call: _GenerateCall) -> None:
        batch = self._prefill(call)
        if self.speculative is not None:
            self.speculative.begin(batch, call.requests)
        finished = self._emit(batch, batch.pending[:, None], torch.ones_like(batch.pending), call.sampling)
        self._retire(batch, finished, call)
        while batch.size > 0:
            if call.on_decode_step is None:
                self._retire(batch, self._advance(batch, call), call)
            else:
                call.on_decode_step(self._timed_step(batch, call))

    def _advance(self, batch: RunningBatch, call: _GenerateCall) -> torch.Tensor:
        """One decode step (plain or speculative) with its tokens emitted; which rows finished [B] bool."""
        if self.speculative is not None:
            new_tokens, counts = self.speculative.step(self.target, batch, call.sampling, call.generator)
        else:
            new_tokens, counts = self.target.decode_step(batch, call.sampling, call.generator)
        return self._emit(batch, new_tokens, counts, call.sampling)

    def _timed_step(self, batch: RunningBatch, call: _GenerateCall) -> DecodeStep:
        """A decode step and its retirements, measured (only calls with an on_decode_step observer pay for it)."""
        started, batch_size, generated_before = time.perf_counter(), batch.size, int(batch.generated.sum())
        finished = self._advance(batch, call)
        tokens = int(batch.generated.sum()) - generated_before  # counted before finished rows leave
        self._retire(batch, finished, call)
        return DecodeStep(batch_size, tokens, time.perf_counter() - started)

    def _prefill(self, call: _GenerateCall) -> RunningBatch:
        """Run all prompts (right-padded, causal) and draw each row's first response token."""
        requests = call.requests
        prompt_lengths = torch.tensor([len(request.prompt_ids) for request in requests], device=self.device)
        longest = int(prompt_lengths.max())
        capacity = longest + INITIAL_SLACK
        tokens = torch.full((len(requests), capacity), self.pad_token_id, dtype=torch.long, device=self.device)
        for row, request in enumerate(requests):
            tokens[row, : len(request.prompt_ids)] = torch.tensor(request.prompt_ids, device=self.device)
        batch = RunningBatch(
            request_index=torch.arange(len(requests), device=self.device),
            prompt_lengths=prompt_lengths,
            lengths=torch.zeros_like(prompt_lengths),
            pending=torch.zeros_like(prompt_lengths),
            generated=torch.zeros_like(prompt_lengths),
            finished_by_eos=torch.zeros_like(prompt_lengths, dtype=torch.bool),
            tokens=tokens,
            cache=self.decode_model.new_cache(len(requests), capacity),
            store_hidden=call.return_hidden
            or call.logprob_temperature is not None
            or (self.speculative is not None and self.speculative.drafter is not None),
        )
        causal = torch.ones(longest, longest, dtype=torch.bool, device=self.device).tril()
        positions = torch.arange(longest, device=self.device).expand(len(requests), longest)
        hidden = self.target.forward_block(batch, tokens[:, :longest], positions, causal)
        last_hidden = hidden[torch.arange(len(requests), device=self.device), prompt_lengths - 1]
        batch.lengths = prompt_lengths.clone()
        batch.pending = next_tokens(self.target.logits(last_hidden), call.sampling, call.generator)
        return batch

    def _emit(self, batch: RunningBatch, new_tokens: torch.Tensor, counts: torch.Tensor, sampling) -> torch.Tensor:
        """Append the first counts[b] of new_tokens [B, E] to each response, cut at EOS and at
        max_new_tokens; return which rows are finished [B] bool."""
        offsets = torch.arange(new_tokens.shape[1], device=self.device)
        budget = sampling.max_new_tokens - batch.generated
        valid = (offsets[None, :] < counts[:, None]) & (offsets[None, :] < budget[:, None])
        is_eos = (new_tokens == self.eos_token_id) & valid
        # drop everything after the first EOS (an EOS itself is kept)
        valid = valid & ((is_eos.long().cumsum(dim=1) - is_eos.long()) == 0)
        write_positions = batch.prompt_lengths + batch.generated
        needed = int(write_positions.max()) + new_tokens.shape[1]
        if needed > batch.tokens.shape[1]:
            batch.tokens = _grown_columns(batch.tokens, max(needed, 2 * batch.tokens.shape[1]), self.pad_token_id)
        batch.tokens.scatter_(1, write_positions[:, None] + offsets[None, :], new_tokens)
        batch.generated = batch.generated + valid.sum(dim=1)
        batch.finished_by_eos = batch.finished_by_eos | is_eos.any(dim=1)
        return batch.finished_by_eos | (batch.generated >= sampling.max_new_tokens)

    def _retire(self, batch: RunningBatch, finished: torch.Tensor, call: _GenerateCall) -> None:
        """Turn finished rows into Completions and drop them from the running batch."""
        if not bool(finished.any()):
            return
        end = time.time()
        rows = finished.nonzero().flatten().tolist()
        logprobs = self._rollout_logprobs(batch, rows, call.logprob_temperature)
        for row, rollout_logprobs in zip(rows, logprobs):
            completion = self._completion(batch, row, call, end, rollout_logprobs)
            call.completions[int(batch.request_index[row])] = completion
            if call.on_request_finished is not None:
                call.on_request_finished(completion)
        keep = (~finished).nonzero().flatten()
        if self.speculative is not None:
            # before the batch drops the finished rows: the n-gram index reads their last tokens
            self.speculative.keep_rows(batch, keep)
        batch.keep_rows(keep)

    def _rollout_logprobs(
        self, batch: RunningBatch, rows: list[int], temperature: float | None
    ) -> list[torch.Tensor | None]:
        """Each row's [R] log-probs of its response tokens under the decode model, in one chunked head pass over
        the rows' hidden states (None per row when not asked for)."""
        if temperature is None:
            return [None] * len(rows)
        hidden = torch.cat([_response_hidden(batch, row) for row in rows])
        tokens = torch.cat([_response_tokens(batch, row) for row in rows])
        values = decoded_logprobs(self.decode_model, hidden, tokens, temperature)
        return list(values.split([int(batch.generated[row]) for row in rows]))

    def _completion(
        self, batch: RunningBatch, row: int, call: _GenerateCall, end: float, rollout_logprobs: torch.Tensor | None
    ) -> Completion:
        request = call.requests[int(batch.request_index[row])]
        target_hidden = _response_hidden(batch, row).clone() if call.return_hidden else None
        stats = self.speculative.stats(row) if self.speculative is not None else SpeculativeStats()
        return Completion(
            request_id=request.request_id,
            prompt_ids=request.prompt_ids,
            response_ids=_response_tokens(batch, row).tolist(),
            finished_by_eos=bool(batch.finished_by_eos[row]),
            start=call.start,
            end=end,
            speculative=stats,
            target_hidden=target_hidden,
            rollout_logprobs=rollout_logprobs,
        )


def _response_hidden(batch: RunningBatch, row: int) -> torch.Tensor:
    """[R, H] the target hidden states that produced row's response tokens: position P-1+i produced token i."""
    prompt_length, generated = int(batch.prompt_lengths[row]), int(batch.generated[row])
    return batch.cache.extra[row, 0, prompt_length - 1 : prompt_length - 1 + generated]


def _response_tokens(batch: RunningBatch, row: int) -> torch.Tensor:
    """[R] row's response token ids."""
    prompt_length, generated = int(batch.prompt_lengths[row]), int(batch.generated[row])
    return batch.tokens[row, prompt_length : prompt_length + generated]


def _check_inputs(requests: Sequence[RolloutRequest], sampling: SamplingParams) -> None:
    if sampling.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens is {sampling.max_new_tokens}; set it to at least 1.")
    if sampling.temperature < 0:
        raise ValueError(f"temperature is {sampling.temperature}; set it to 0 (greedy) or a positive value.")
    for request in requests:
        if len(request.prompt_ids) == 0:
            raise ValueError(f"request {request.request_id} has an empty prompt; give it at least one token.")


def _step_observer(*observers: Callable[[DecodeStep], None] | None) -> Callable[[DecodeStep], None] | None:
    """One decode-step callback calling each given observer in turn (None when none is given)."""
    given = [observer for observer in observers if observer is not None]
    if len(given) <= 1:
        return given[0] if given else None

    def observe(step: DecodeStep) -> None:
        for observer in given:
            observer(step)

    return observe


def _grown_columns(tokens: torch.Tensor, columns: int, pad_token_id: int) -> torch.Tensor:
    grown = tokens.new_full((tokens.shape[0], columns), pad_token_id)
    grown[:, : tokens.shape[1]] = tokens
    return grown


@contextlib.contextmanager
def _eval_mode(module: nn.Module | None) -> Iterator[None]:
    """Put `module` in eval mode for the block, then put back in training mode exactly the
    submodules that were in it."""
    training = [submodule for submodule in module.modules() if submodule.training] if module is not None else []
    for submodule in training:
        submodule.training = False
    try:
        yield
    finally:
        for submodule in training:
            submodule.training = True
