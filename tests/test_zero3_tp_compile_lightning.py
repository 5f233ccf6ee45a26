"""zstack_zero3 with tensor_parallel_size=2 and with compile=True through a real Lightning Trainer on 2 CPU ranks:
parity with a single-process reference (losses and parameters)."""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

from tests._lightning_models import TinyGPTModule, loader
from tests._zero_models import batches, gpt_loss
from zlightning.testing import run_distributed

WORLD, N_BATCHES, STEPS, LR = 2, 6, 3, 0.05


class SGDModule(TinyGPTModule):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        # SGD with momentum: Adam turns ~1e-9 reduction-order noise on near-zero gradients into visible updates
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


class BuiltInConfigureModel(SGDModule):
    """The same model built in ``configure_model`` (meta device, recorded): tensor parallelism needs it whole."""

    def __init__(self) -> None:
        pl.LightningModule.__init__(self)
        self.model: Any = None
        self.lr = LR
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.model is None:
            from tests._zero_models import tiny_gpt

            self.model = tiny_gpt()


def _fit(rank: int, world: int, strategy_kwargs: dict[str, Any]) -> dict[str, Any]:
    from zlightning.strategies import ZStackZero3Strategy

    import zlightning  # noqa: F401
    from zlightning.inject import tp_full_state

    pl.seed_everything(0, verbose=False)
    strategy_kwargs = dict(strategy_kwargs)
    module = BuiltInConfigureModel() if strategy_kwargs.pop("configure_model", False) else SGDModule()
    strategy = ZStackZero3Strategy(**strategy_kwargs)
    graphs: list[int] = []

    class _Graphs(pl.Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            handle = strategy._compiled
            graphs.append(handle.stats.graphs if handle is not None else 0)

    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=world,
        max_steps=STEPS,
        logger=False,
        callbacks=[_Graphs()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, train_dataloaders=loader(N_BATCHES, 2, world))
    tp = strategy.tensor_parallel_size > 1
    from zlightning.zero import summon_full_params

    with summon_full_params(module):  # the module stays sharded after fit
        state = (
            tp_full_state(module.model) if tp else {k: v.detach().clone() for k, v in module.model.state_dict().items()}
        )
    return {"losses": module.losses, "state": state, "graphs": graphs}


def _global_batches(dp: int) -> list[torch.Tensor]:
    """What the Trainer feeds: the dataset of `loader`, split by a seeded DistributedSampler over the dp replicas."""
    data = torch.cat(batches(N_BATCHES, 2 * WORLD))
    per_replica = [
        data[list(DistributedSampler(TensorDataset(data), num_replicas=dp, rank=r, shuffle=True, seed=0))]
        for r in range(dp)
    ]
    return [torch.cat([p[2 * i : 2 * i + 2] for p in per_replica]) for i in range(len(per_replica[0]) // 2)]


def _reference(dp: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    torch.manual_seed(0)
    module = SGDModule()
    opt = module.configure_optimizers()
    losses = []
    for batch in _global_batches(dp)[:STEPS]:
        loss = gpt_loss(module.model, batch)
        losses.append(float(loss.detach()))
        loss.backward()
        opt.step()
        opt.zero_grad()
    return copy.deepcopy(module.model.state_dict()), losses


@pytest.mark.parametrize(
    ("kwargs", "dp"),
    [
        ({"tensor_parallel_size": 2}, 1),
        ({"tensor_parallel_size": 2, "configure_model": True}, 1),
        ({"compile": True}, 2),
    ],
    ids=["tp2", "tp2_configure_model", "compile"],
)
def test_tp_and_compile_match_single_process(kwargs: dict[str, Any], dp: int) -> None:
    out = run_distributed(_fit, WORLD, kwargs, init_process_group=False, timeout=400)
    ref_state, ref_losses = _reference(dp)
    for r in out:
        assert len(r["losses"]) == STEPS
        if kwargs.get("compile"):  # compiled on the first step, never recompiled afterwards
            assert r["graphs"][0] >= 1 and r["graphs"] == [r["graphs"][0]] * STEPS, r["graphs"]
    # each data-parallel replica's micro-batch losses average to the reference loss of the global batch
    mean = [sum(out[k]["losses"][i] for k in range(0, WORLD, WORLD // dp)) / dp for i in range(STEPS)]
    torch.testing.assert_close(mean, ref_losses, rtol=1e-5, atol=1e-6)
    for r in out:
        for name, value in ref_state.items():
            torch.testing.assert_close(r["state"][name], value, rtol=1e-5, atol=1e-6, msg=name)
