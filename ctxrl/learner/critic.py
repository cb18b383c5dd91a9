"""The value model for PPO with GAE: a causal-LM trunk and a linear value head.

``Critic(lm)`` reads the last hidden state of ``lm``'s backbone (``lm.base_model``, so the
vocabulary projection is never computed) and maps it to one value per position. Alignment is
the learner's: the value of token ``x[t+1]`` comes from position ``t``, so ``values[:, t]`` lines
up with the shifted loss mask, exactly like the log-probs. The head starts at zero, so with
lambda = 1 the first advantages are the plain discounted returns to go.

The usual initialisation is a copy of the warm-started policy (``Critic(copy.deepcopy(policy))``):
a trunk that already reads the task. It is trained by its own optimiser on the clipped value loss
(``ctxrl.algo.value.value_loss``) in the same mini-batches as the policy.
"""

from __future__ import annotations

import torch

from ctxrl.models.kernels import attention_kernels
from ctxrl.types import Episode


class Critic(torch.nn.Module):
    def __init__(self, lm) -> None:
        super().__init__()
        self.lm = lm
        self.head = torch.nn.Linear(lm.config.hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)
        self.head.to(next(lm.parameters()).device)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Values [B, T-1]: position t scores the state before token t+1."""
        with attention_kernels(input_ids.device):
            hidden = self.lm.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.head(hidden[:, :-1].to(self.head.weight.dtype)).squeeze(-1).float()


@torch.no_grad()
def episode_values(critic: Critic, episodes: list[Episode], pad_token_id: int, *, micro_batch_size: int = 32,
                   max_tokens: int = 0) -> list[list[float]]:
    """Per episode, one value per token aligned with ``input_ids`` (index 0, the first prompt token, gets 0)."""
    from ctxrl.learner.batch import collate, per_token_rows

    device = next(critic.parameters()).device
    return per_token_rows(collate(episodes, pad_token_id), device, micro_batch_size,
                          lambda batch: critic(batch.input_ids, batch.attention_mask), max_tokens)
