"""The ``weights_only`` a user passed to ``trainer.fit/validate/test/predict``, for strategies that restore after setup.

[Note: Lightning's weights_only after setup]
``trainer.fit(..., ckpt_path=..., weights_only=False)`` is how a Lightning user opts in to full unpickling of a
trusted checkpoint. Lightning 2.6 hands that argument to ``Strategy.load_checkpoint`` only when the strategy restores
*before* setup (``Trainer._run``: ``_restore_modules_and_callbacks(ckpt_path, weights_only)``); a strategy that
restores after setup (``restore_checkpoint_after_setup``, as ours must: the engine has to exist to take the shards)
is called through ``_restore_modules_and_callbacks(ckpt_path)`` and receives None. `requested_weights_only` recovers
the user's value from the ``Trainer._run`` frame that is loading the checkpoint. A value Lightning does pass wins; when
no such frame is found (a Lightning that restructured ``_run``) the answer is None, which loads weights-only: the
failure mode is the safe one.
"""

from __future__ import annotations

import inspect

__all__ = ["requested_weights_only"]


def requested_weights_only(passed: bool | None) -> bool | None:
    """The caller's ``weights_only`` for the checkpoint being loaded. See [Note: Lightning's weights_only after setup].

    Args:
        passed: what ``Strategy.load_checkpoint`` received.

    Returns:
        ``passed`` when it is not None, else the ``weights_only`` of the enclosing ``Trainer._run`` (None when there
        is none).
    """
    if passed is not None:
        return passed
    from lightning.pytorch.trainer.trainer import Trainer

    run = Trainer._run.__code__
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code is run:
                value = frame.f_locals.get("weights_only")
                return value if isinstance(value, bool) else None
            frame = frame.f_back
        return None
    finally:
        del frame  # a frame referencing itself would keep every local of the stack alive
