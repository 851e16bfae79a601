"""Prompt tuning (Lester et al. 2021, "The Power of Scale for Parameter-Efficient Prompt Tuning").

Per task, ``prompt_length`` trainable vectors are inserted into the embedded input right after [CLS] (the
``embeddings.input_prompt`` hook, after the embedding LayerNorm and dropout); the attention mask gets ones there,
the real tokens keep their position embeddings, the prompt vectors carry none; the backbone stays frozen. Each
task has its own prompt (``embeddings.input_prompt.per_task.<task>.prompt``). Init: ``vocab`` (sampled vocabulary
tokens as the embedding layer presents them, the default) or ``random`` (uniform in [-0.5, 0.5]); dropout applies
to the prompt vectors. Details: docs/methods.md, "Prompt tuning".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from peftune.base.errors import UserError
from peftune.inputs.backbone import BertConfig, BertModel
from peftune.inputs.dropout import Dropout
from peftune.methods.base import (
    BERT_POSITIONS,
    MAX_BERT_POSITIONS,
    MethodConfig,
    MethodSpec,
    TaskContext,
    check_at_most,
    check_positive_int,
    option,
    register_method,
)

PROMPT_INITS = ("vocab", "random")
RANDOM_INIT_RANGE = 0.5  # Lester et al.'s random-uniform init: U(-0.5, 0.5)


@dataclass
class PromptConfig(MethodConfig):
    # Lester et al.: 20 tokens are close to the best length (100 gains little) at their larger sizes
    prompt_length: int = option(20, "prompt length")
    # sampled vocabulary embeddings beat random init in Lester et al.
    init: str = "vocab"

    def __post_init__(self):
        super().__post_init__()
        check_positive_int(self, "prompt_length", MAX_BERT_POSITIONS, BERT_POSITIONS)
        if self.init not in PROMPT_INITS:
            raise UserError(f"PromptConfig.init = {self.init!r}; expected one of {list(PROMPT_INITS)}")

    def check_backbone(self, bert: BertConfig) -> None:
        check_at_most(self, "prompt_length", bert.max_position_embeddings, "its max_position_embeddings")
        super().check_backbone(bert)


def prompt_parameter_count(config: PromptConfig, bert_config: BertConfig, num_tasks: int = 1) -> dict[str, int]:
    """Closed-form parameter counts of prompt tuning (task heads excluded).

    trainable_per_task = stored_per_task = prompt_length * hidden_size;
    *_total = num_tasks * *_per_task (nothing is shared across tasks).
    """
    per_task = config.prompt_length * bert_config.hidden_size
    return {
        "trainable_per_task": per_task,
        "stored_per_task": per_task,
        "trainable_total": num_tasks * per_task,
        "stored_total": num_tasks * per_task,
    }


class TaskPrompt(nn.Module):
    def __init__(self, prompt: torch.Tensor):
        super().__init__()
        self.prompt = nn.Parameter(prompt)  # (P, H)


class PromptInserter(nn.Module):
    """The ``input_prompt`` hook: inserts the current task's prompt after [CLS]."""

    def __init__(self, prompts: dict[str, torch.Tensor], dropout: float, context: TaskContext):
        super().__init__()
        self.context = context
        self.per_task = nn.ModuleDict({task: TaskPrompt(prompt) for task, prompt in prompts.items()})
        # P: the inserted positions are 1 .. P of the output sequence (callers may pool without them)
        self.length = next(iter(prompts.values())).shape[0]
        self.dropout = Dropout(dropout)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: (B, T, H) embedded tokens; attention_mask: (B, T)
        B = x.shape[0]
        prompt = self.per_task[self.context.task].prompt  # (P, H)
        prompt = self.dropout(prompt.expand(B, -1, -1)).to(x.dtype)  # (B, P, H), a mask per example
        x = torch.cat([x[:, :1], prompt, x[:, 1:]], dim=1)  # (B, T + P, H): [CLS] prompt tokens...
        ones = attention_mask.new_ones(B, prompt.shape[1])  # (B, P): every token sees the prompt
        attention_mask = torch.cat([attention_mask[:, :1], ones, attention_mask[:, 1:]], dim=1)  # (B, T + P)
        return x, attention_mask


@torch.no_grad()
def initial_prompt(config: PromptConfig, backbone: BertModel) -> torch.Tensor:
    """A fresh (P, H) prompt, initialised as ``config.init`` says (global torch RNG)."""
    bert = backbone.config
    P, H = config.prompt_length, bert.hidden_size
    weight = backbone.embeddings.word_embeddings.weight
    if config.init == "random":
        return torch.empty(P, H, dtype=weight.dtype, device=weight.device).uniform_(
            -RANDOM_INIT_RANGE, RANDOM_INIT_RANGE
        )
    # uniform over the vocabulary without the padding id: draw from V - 1 ids, skip past the pad
    ids = torch.randint(0, bert.vocab_size - 1, (P,), device=weight.device)
    ids = ids + (ids >= bert.pad_token_id).long()
    return backbone.token_vectors(ids).clone()  # (P, H), as the embedding layer outputs a token


def apply_prompt(backbone: BertModel, config: PromptConfig, context: TaskContext) -> None:
    if backbone.embeddings.input_prompt is not None:
        raise UserError("the backbone already has an input_prompt installed; prompt tuning applies once")
    config.check_backbone(backbone.config)
    prompts = {task: initial_prompt(config, backbone) for task in context.tasks}
    backbone.embeddings.input_prompt = PromptInserter(prompts, config.dropout, context)


register_method(
    MethodSpec(
        "prompt",
        PromptConfig,
        apply_prompt,
        "prompt tuning: per-task trainable vectors inserted after [CLS] in the input embeddings",
        size_field="prompt_length",
        order=10,
        color="#393b79",
        size_symbols={"prompt_length": "l"},
    )
)
