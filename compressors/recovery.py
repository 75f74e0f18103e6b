"""Distillation: a student learns a teacher's next-token distributions on token windows.

Two users: recovery after structured pruning or KV-head merging (the student is the smaller
model, the teacher its parent, run live) and draft distillation (the student is the draft, the
teacher the target, whose final hidden states are cached). Written here rather than with a
trainer library because it is one loop (teacher log-probabilities, student logits, loss, AdamW
step) and the checkpoint format must be safetensors, not a trainer's pickles.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

LOSSES = ("kl", "tvd")


def distribution_loss(student_logits: torch.Tensor, teacher_logprobs: torch.Tensor, kind: str = "kl") -> torch.Tensor:
    """Per-token mean of KL(teacher || student) ("kl", forward KL) or of the total variation
    distance 1/2 sum |p_teacher - p_student| ("tvd", the quantity that bounds a draft's
    rejection rate under speculative sampling, as DistillSpec uses)."""
    student_logprobs = student_logits.float().log_softmax(dim=-1).flatten(0, -2)
    teacher_logprobs = teacher_logprobs.flatten(0, -2)
    if kind == "kl":
        return torch.nn.functional.kl_div(student_logprobs, teacher_logprobs, log_target=True, reduction="batchmean")
    return 0.5 * (student_logprobs.exp() - teacher_logprobs.exp()).abs().sum(-1).mean()


class TrainingCheckpoint:
    """Resumable training state in one safetensors file: the trained parameters, AdamW's
    moments and step counts, and (in the metadata) the step reached and the losses so far.
    Saved every `every` steps by writing a sibling and renaming it over the old one. `saved`
    is the state to continue from (`TrainingCheckpoint.read` of the file), or None."""

    def __init__(self, path: Path, every: int, saved: tuple[dict[str, torch.Tensor], list[float]] | None = None):
        self.path, self.every, self.saved = Path(path), every, saved

    @staticmethod
    def read(path: Path) -> tuple[dict[str, torch.Tensor], list[float]]:
        """Every saved tensor and the losses so far, read in full before any is applied."""
        with safe_open(path, framework="pt") as handle:
            losses = json.loads(handle.metadata()["losses"])
            return {key: handle.get_tensor(key) for key in handle.keys()}, [float(loss) for loss in losses]

    def restore(self, named: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer) -> list[float]:
        """Load the saved state into the parameters and optimizer; returns the losses so far
        (their count is the step to continue from), or [] when there is none."""
        if self.saved is None:
            return []
        tensors, losses = self.saved
        for name, parameter in named.items():
            with torch.no_grad():
                parameter.copy_(tensors[f"param/{name}"])
            state = {key: tensors[f"{key}/{name}"] for key in ("step", "exp_avg", "exp_avg_sq") if f"{key}/{name}" in tensors}
            state = {key: value if key == "step" else value.to(parameter.device) for key, value in state.items()}  # AdamW keeps step on the CPU
            if state:  # a parameter that got no gradient yet has no AdamW state
                optimizer.state[parameter] = state
        return list(losses)

    def save(self, named: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer, losses: list[float]) -> None:
        tensors = {}
        for name, parameter in named.items():
            tensors[f"param/{name}"] = parameter.detach().cpu().contiguous()
            for key, value in optimizer.state[parameter].items():
                tensors[f"{key}/{name}"] = value.cpu().contiguous()
        partial = self.path.with_name(self.path.name + ".partial")
        save_file(tensors, partial, metadata={"losses": json.dumps(losses)})
        partial.replace(self.path)


def distill(
    student: nn.Module,
    teacher_logprobs: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    input_ids: torch.Tensor,
    steps: int,
    lr: float = 5e-5,
    batch_size: int = 2,
    seed: int = 0,
    loss: str = "kl",
    student_logits: Callable[[torch.Tensor], torch.Tensor] | None = None,
    checkpoint: TrainingCheckpoint | None = None,
    on_step: Callable[[int, float], None] | None = None,
    cosine_decay: bool = False,
) -> list[float]:
    """Train the student's parameters that require grad for `steps` batches of `input_ids`
    (in a seeded shuffled order, cycled: calibration windows are stored grouped by corpus part,
    so in-order batches would train on one part first); returns the loss of each step.

    `teacher_logprobs(rows, ids)` gives the teacher's log-probabilities for the windows `rows`
    (their token ids `ids`); `student_logits(ids)` the student's logits over the same
    vocabulary (default: the student's own forward). With a `checkpoint`, training resumes
    from its saved step and saves every `checkpoint.every` steps: an interrupted run continues
    to the same result as an uninterrupted one. `cosine_decay`: the learning rate falls from
    `lr` to 0 along a half cosine over the steps (set from the step, so resuming keeps it)."""
    torch.manual_seed(seed)
    student.train()
    named = {name: p for name, p in student.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW(list(named.values()), lr=lr, weight_decay=0.0)
    order = torch.randperm(input_ids.shape[0], generator=torch.Generator().manual_seed(seed))
    batches = order.split(batch_size)
    forward = student_logits or (lambda ids: student(input_ids=ids, use_cache=False).logits)
    losses = checkpoint.restore(named, optimizer) if checkpoint is not None else []
    for step in range(len(losses), steps):
        if cosine_decay:
            for group in optimizer.param_groups:
                group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / steps))
        rows = batches[step % len(batches)]
        ids = input_ids[rows]
        with torch.no_grad():
            target = teacher_logprobs(rows, ids)
        value = distribution_loss(forward(ids), target, loss)
        optimizer.zero_grad(set_to_none=True)
        value.backward()
        optimizer.step()
        losses.append(value.item())
        if checkpoint is not None and ((step + 1) % checkpoint.every == 0 or step + 1 == steps):
            checkpoint.save(named, optimizer, losses)
        if on_step is not None:
            on_step(step, losses[-1])
    student.eval()
    return losses


def live_teacher(teacher: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Teacher log-probabilities from running the teacher model on the batch."""
    teacher.eval()
    return lambda rows, ids: teacher(input_ids=ids, use_cache=False).logits.float().log_softmax(dim=-1)
