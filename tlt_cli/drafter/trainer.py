"""Training the drafter: the batch type, collecting it from a target forward, and the optimiser step.

The shift, once for everyone: a sequence x[0..L-1] with target hidden states h[0..L-1]
(h[t] = last_hidden_state at position t, what lm_head turns into the distribution of x[t+1])
gives T = L-1 drafter features. Feature t pairs token x[t+1] with h[t], and is trained to
predict h[t+1] (and so, through lm_head, the distribution of x[t+2]). It counts in the loss when
x[t+1] and x[t+2] are both response tokens: exactly the features the drafter sees while drafting
a response (the first one pairs the first response token with the last prompt hidden state).

`collect_drafter_batch` builds a `DrafterBatch` from one no-grad target forward over full
sequences; the drafter sidecar and the warm-up feed those batches to `DrafterTrainer.train_step`
(AdamW on the drafter's own parameters, grad clip, non-finite steps skipped).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, fields

import torch
from transformers import PreTrainedModel

from tlt_cli.drafter.loss import EAGLE_OBJECTIVE, DrafterLoss, DrafterObjective, combined_loss, drafter_loss
from tlt_cli.drafter.model import EagleDrafter
from tlt_cli.drafter.unrolled import unrolled_loss_mask, unrolled_outputs

logger = logging.getLogger(__name__)


def real_token_mask(sequence_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """[B,L] bool, true on real tokens: the attention mask, or all true when there is none."""
    return torch.ones_like(sequence_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()


@dataclass
class DrafterBatch:
    """Drafter training features of B sequences, already shifted (see the module docstring).

    input_ids: [B,T] token x[t+1]; target_hidden: [B,T,H] h[t]; target_hidden_next: [B,T,H] h[t+1];
    position_ids: [B,T] position of h[t]; valid_mask: [B,T] bool, x[t] and x[t+1] are real tokens;
    loss_mask: [B,T] bool, x[t+1] and x[t+2] are response tokens.
    """

    input_ids: torch.Tensor
    target_hidden: torch.Tensor
    target_hidden_next: torch.Tensor
    position_ids: torch.Tensor
    valid_mask: torch.Tensor
    loss_mask: torch.Tensor

    @classmethod
    def from_sequences(
        cls,
        sequence_ids: torch.Tensor,
        hidden_states: torch.Tensor,
        response_mask: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
    ) -> DrafterBatch:
        """sequence_ids: [B,L]; hidden_states: [B,L,H] target last_hidden_state; response_mask: [B,L]
        bool, true on response tokens; attention_mask: [B,L] bool, true on real (non-padding) tokens."""
        token_valid = real_token_mask(sequence_ids, attention_mask)
        response = response_mask.bool() & token_valid
        # feature t predicts x[t+2]: counts when x[t+1] and x[t+2] are response tokens; the last feature never does
        predicts_response = torch.zeros_like(response[:, 1:])
        predicts_response[:, :-1] = response[:, 1:-1] & response[:, 2:]
        # positions count real tokens only, so left padding does not shift them
        positions = (token_valid.long().cumsum(-1) - 1).clamp(min=0)
        return cls(
            input_ids=sequence_ids[:, 1:],
            target_hidden=hidden_states[:, :-1],
            target_hidden_next=hidden_states[:, 1:],
            position_ids=positions[:, :-1],
            valid_mask=token_valid[:, :-1] & token_valid[:, 1:],
            loss_mask=predicts_response,
        )

    @classmethod
    def concatenate(cls, batches: list[DrafterBatch]) -> DrafterBatch:
        """Stack batches along B, right-padding shorter ones (padding is invalid and never counted)."""
        length = max(batch.input_ids.shape[1] for batch in batches)
        padded = [batch.right_padded(length) for batch in batches]
        return cls(**{field.name: torch.cat([getattr(batch, field.name) for batch in padded]) for field in fields(cls)})

    def right_padded(self, length: int) -> DrafterBatch:
        extra = length - self.input_ids.shape[1]

        def pad(tensor: torch.Tensor) -> torch.Tensor:
            filler = tensor.new_zeros((tensor.shape[0], extra, *tensor.shape[2:]))
            return torch.cat((tensor, filler), dim=1)

        return DrafterBatch(**{field.name: pad(getattr(self, field.name)) for field in fields(self)})

    def rows(self, indices: torch.Tensor) -> DrafterBatch:
        """The sub-batch of the given sequence indices."""
        return DrafterBatch(**{field.name: getattr(self, field.name)[indices] for field in fields(self)})

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def next_token_ids(self) -> torch.Tensor:
        """[B,T] token x[t+2], the one feature t predicts (zero past the end, never counted)."""
        return torch.cat((self.input_ids[:, 1:], torch.zeros_like(self.input_ids[:, :1])), dim=1)

    def attention_mask(self) -> torch.Tensor:
        """[B,1,T,T] bool: causal over valid features; every feature also sees itself (no empty rows)."""
        length = self.input_ids.shape[1]
        causal = torch.tril(torch.ones(length, length, dtype=torch.bool, device=self.input_ids.device))
        diagonal = torch.eye(length, dtype=torch.bool, device=self.input_ids.device)
        return ((causal & self.valid_mask[:, None, :]) | diagonal)[:, None]


@torch.no_grad()
def collect_drafter_batch(
    target: PreTrainedModel,
    sequences: torch.Tensor,
    response_mask: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
) -> DrafterBatch:
    """One no-grad target forward over full sequences -> the DrafterBatch of their response tokens.

    sequences: [B,L] prompt + response ids (padded on either side); response_mask: [B,L] bool;
    attention_mask: [B,L] bool, true on real tokens (None: no padding).
    """
    token_valid = real_token_mask(sequences, attention_mask)
    position_ids = (token_valid.long().cumsum(-1) - 1).clamp(min=0)
    hidden_states = target.get_decoder()(
        input_ids=sequences, attention_mask=token_valid.long(), position_ids=position_ids
    ).last_hidden_state
    return DrafterBatch.from_sequences(sequences, hidden_states, response_mask, token_valid)


def drafter_forward_loss(
    drafter: EagleDrafter,
    batch: DrafterBatch,
    objective: DrafterObjective = EAGLE_OBJECTIVE,
    target_tokens_next: torch.Tensor | None = None,
    target_log_normalizer: torch.Tensor | None = None,
) -> DrafterLoss:
    """The drafter's loss on a batch, unrolled over the objective's draft depths (tlt_cli/drafter/unrolled.py);
    the target's next-token logits over the draft tokens come from the same rows of its lm_head the drafter
    uses. target_tokens_next, target_log_normalizer: see `drafter_loss`."""
    with torch.no_grad():
        target_logits_next = drafter.draft_logits(batch.target_hidden_next)
    outputs = unrolled_outputs(
        drafter,
        batch.input_ids,
        batch.target_hidden,
        batch.position_ids,
        batch.valid_mask,
        batch.attention_mask(),
        objective.depths,
    )
    losses = [
        drafter_loss(
            output,
            batch.target_hidden_next,
            target_logits_next,
            unrolled_loss_mask(batch.loss_mask, depth),
            drafter.vocabulary,
            target_tokens_next,
            objective,
            target_log_normalizer,
        )
        for depth, output in enumerate(outputs, start=1)
    ]
    return combined_loss(losses)


@torch.no_grad()
def target_argmax_and_normalizer(
    lm_head: torch.nn.Module, hidden: torch.Tensor, temperature: float, chunk_positions: int = 256
) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax, logsumexp(logits / temperature)) over the whole vocabulary of lm_head(hidden) [..., H], each
    [...], a few positions at a time so a 150k-token vocabulary never holds more than chunk_positions rows of
    logits."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    tokens, normalizers = [], []
    for start in range(0, flat.shape[0], chunk_positions):
        logits = lm_head(flat[start : start + chunk_positions]).float()
        tokens.append(logits.argmax(-1))
        normalizers.append(torch.logsumexp(logits / temperature, dim=-1))
    return torch.cat(tokens).view(hidden.shape[:-1]), torch.cat(normalizers).view(hidden.shape[:-1])


@torch.no_grad()
def evaluate_drafter(
    drafter: EagleDrafter,
    batch: DrafterBatch,
    target_tokens_next: torch.Tensor | None = None,
    objective: DrafterObjective = EAGLE_OBJECTIVE,
) -> DrafterLoss:
    """Loss, top-1 agreement with the target's next token and the sampled acceptance at the objective's
    temperature against the target's whole-vocabulary distribution, without training (eval mode).

    target_tokens_next: [B,T] the token the target chose after each position (for greedy
    generations, the sequence's own next token: `batch.next_token_ids()`); None: the target's
    argmax over its whole vocabulary, computed here.
    """
    was_training = drafter.training
    drafter.eval()
    argmax, normalizer = target_argmax_and_normalizer(
        drafter.shared.lm_head, batch.target_hidden_next, objective.temperature
    )
    target_tokens_next = argmax if target_tokens_next is None else target_tokens_next
    loss = drafter_forward_loss(drafter, batch, objective, target_tokens_next, normalizer)
    drafter.train(was_training)
    return loss.detached()


class DrafterTrainer:
    """AdamW on the drafter's own parameters (the shared target modules are not among them).

    Example:
        trainer = DrafterTrainer(drafter, lr=3e-4, weight_decay=0.0, objective=acceptance_objective(0.7))
        loss = trainer.train_step(collect_drafter_batch(target, sequences, response_mask))
    """

    def __init__(
        self,
        drafter: EagleDrafter,
        lr: float,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        grad_clip: float = 1.0,
        objective: DrafterObjective = EAGLE_OBJECTIVE,
    ):
        self.drafter = drafter
        self.objective = objective
        self.grad_clip = grad_clip
        self.optimizer = torch.optim.AdamW(drafter.parameters(), lr=lr, weight_decay=weight_decay, betas=betas)
        self.steps_taken = 0
        self.steps_skipped = 0

    def train_step(self, batch: DrafterBatch) -> DrafterLoss:
        """One optimiser step; a non-finite loss or gradient skips it (parameters untouched, step_skipped set)."""
        self.drafter.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss = drafter_forward_loss(self.drafter, batch, self.objective)
        if not loss.is_finite:
            return self.skip(loss, "loss")
        loss.total.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.grad_clip)
        if not torch.isfinite(grad_norm):
            return self.skip(loss, "gradient")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps_taken += 1
        return loss.detached()

    def skip(self, loss: DrafterLoss, what: str) -> DrafterLoss:
        self.optimizer.zero_grad(set_to_none=True)
        self.steps_skipped += 1
        logger.warning("Skipped drafter step: non-finite %s (total loss %s).", what, float(loss.total.detach()))
        skipped = loss.detached()
        skipped.step_skipped = True
        return skipped

    def state_dict(self) -> dict:
        """A snapshot (deep copy): later steps do not change it, and loading it does not alias tensors."""
        return copy.deepcopy(
            {
                "drafter": self.drafter.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "steps_taken": self.steps_taken,
                "steps_skipped": self.steps_skipped,
            }
        )

    def load_state_dict(self, state: dict) -> None:
        self.drafter.load_state_dict(state["drafter"])
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        self.steps_taken = state["steps_taken"]
        self.steps_skipped = state["steps_skipped"]
