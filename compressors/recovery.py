"""Recovery after structured pruning: a short knowledge-distillation pass in which the pruned
model (student) learns the parent's (teacher's) next-token distributions on the calibration
tokens. Written here rather than with a trainer library because it is one loop: teacher
log-probabilities, student log-probabilities, KL, AdamW step."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def distill(
    student: nn.Module,
    teacher: nn.Module,
    input_ids: torch.Tensor,
    steps: int,
    lr: float = 5e-5,
    batch_size: int = 2,
    seed: int = 0,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Minimize KL(teacher || student) per token over `steps` batches of `input_ids` (in a
    seeded shuffled order, cycled: calibration windows are stored grouped by corpus part, so
    in-order batches would train on one part first); returns the loss of each step. Every
    student parameter trains; the teacher is frozen."""
    torch.manual_seed(seed)
    teacher.eval()
    student.train()
    optimizer = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    order = torch.randperm(input_ids.shape[0], generator=torch.Generator().manual_seed(seed))
    batches = input_ids[order].split(batch_size)
    losses = []
    for step in range(steps):
        ids = batches[step % len(batches)]
        with torch.no_grad():
            target = teacher(input_ids=ids, use_cache=False).logits.float().log_softmax(dim=-1)
        predicted = student(input_ids=ids, use_cache=False).logits.float().log_softmax(dim=-1)
        loss = torch.nn.functional.kl_div(predicted.flatten(0, 1), target.flatten(0, 1), log_target=True, reduction="batchmean")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1])
    student.eval()
    return losses
