"""Knowledge distillation loss for a layer-reduced student (DeepSpeed left this to user code).

[Note: distillation loss]
``KL(softmax(teacher / T) || softmax(student / T)) * T^2``, averaged over every position (all leading dimensions are
flattened, so ``[batch, seq, vocab]`` logits give a per-token loss). The ``T^2`` factor keeps the gradient scale
independent of the temperature (Hinton et al.), so a weight tuned at one temperature stays sensible at another.
The teacher's logits are detached: no gradient reaches the teacher.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

__all__ = ["distillation_loss"]


def distillation_loss(student_logits: Tensor, teacher_logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Soft-target distillation loss; see [Note: distillation loss].

    Args:
        student_logits: ``[..., classes]`` logits of the student.
        teacher_logits: Logits of the teacher, same shape.
        temperature: Softmax temperature (> 0).

    Returns:
        A scalar (mean over all leading positions), zero when the two distributions agree.

    Raises:
        ValueError: For mismatched shapes or a non-positive temperature.
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"distillation_loss: student logits {tuple(student_logits.shape)} and teacher logits "
            f"{tuple(teacher_logits.shape)} must have the same shape."
        )
    if not temperature > 0:
        raise ValueError(f"distillation_loss: temperature must be > 0, got {temperature!r}.")
    classes = student_logits.shape[-1]
    s = F.log_softmax(student_logits.reshape(-1, classes).float() / temperature, dim=-1)
    t = F.log_softmax(teacher_logits.detach().reshape(-1, classes).float() / temperature, dim=-1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean") * temperature**2
