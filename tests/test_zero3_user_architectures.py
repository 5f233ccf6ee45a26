"""ZeRO-3 through ``Trainer.fit`` on model architectures users train, written as users write them.

Each test trains on 2 gloo CPU ranks (``accumulate_grad_batches=2``, ``gradient_clip_val=0.5``) and compares the
losses and every parameter with one process on the same global batches (fp32, rtol 1e-5). Checked here:

* blocks that return their outputs in a dataclass, or in an object no container walk knows: the engine found no
  tensor to hook for the block's backward, released the block after its forward, and the backward read freed
  parameters ("setStorage: ... out of bounds for storage of size 0"). See [Note: an output autograd cannot be seen
  in] in ``zlightning/zero/_unit.py``.
* a block keeping a result on itself for the model to use (deep supervision: each block's exit classifier keeps
  its logits as ``self.exit_logits``), computed after the block's output: its backward came first and read the
  block's released parameters (the same "setStorage" failure). See [Note: results kept on a module] in ``zlightning/zero/_unit.py``.
* ``nn.TransformerEncoder`` with a padding mask, called twice per ``predict_step`` (test-time augmentation), on
  ranks whose batches are padded on different sides: in eval it reads its first layer's weights itself only for a
  left-aligned mask, that layer then stayed gathered for the rest of the step on those ranks only, and the ranks'
  all-gathers diverged (gloo aborted: "Received data size doesn't match expected size"). See [Note: a read outside
  without grad ends with the unit's use] in ``zlightning/zero/_state.py``.
* an ``nn.Embedding(sparse=True)`` (a recommender's or word2vec's table, trained with SGD): its sparse gradient
  failed to pack for the reduce-scatter ("reshape is not implemented for sparse tensors"). See [Note: sparse
  gradients] in ``zlightning/zero/_param_group.py``. One process cannot clip sparse gradients or decay weights into
  them, so this one trains without either.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from zlightning.testing import run_distributed

WORLD, ACCUMULATE, CLIP, MICRO_BATCHES = 2, 2, 0.5, 4


# ---------------------------------------------------------------- models
@dataclasses.dataclass
class BlockOutput:
    hidden: torch.Tensor
    aux: torch.Tensor | None = None


class Opaque:
    """A result type no container walk knows (neither pytree nor a dataclass)."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.hidden = hidden


class ResidualBlock(nn.Module):
    def __init__(self, d: int, opaque: bool) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)
        self.opaque = opaque

    def forward(self, x: torch.Tensor) -> BlockOutput | Opaque:
        h = x + torch.tanh(self.fc(self.ln(x)))
        return Opaque(h) if self.opaque else BlockOutput(h)


class DataclassBlocksNet(nn.Module):
    """Blocks returning a dataclass (as many code bases do for their layer outputs); the last one an opaque object."""

    def __init__(self, d: int = 48, n_layer: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ResidualBlock(d, opaque=i == n_layer - 1) for i in range(n_layer))
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x).hidden
        return self.head(x)


class SparseEmbeddingNet(nn.Module):
    """A bag-of-ids classifier over a sparse embedding table (the rows looked up get a gradient)."""

    def __init__(self, vocab: int = 500, d: int = 16, n_layer: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d, sparse=True)
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(n_layer))
        self.head = nn.Linear(d, 10)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx).mean(1)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h)


class EarlyExitBlock(nn.Module):
    """A block with its own exit classifier (deep supervision), whose logits it keeps for the model to use."""

    def __init__(self, d: int = 48) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)
        self.exit = nn.Linear(d, 10)
        self.exit_logits = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x + torch.tanh(self.fc(self.ln(x)))
        self.exit_logits = self.exit(out)  # after the output: its backward runs before the output's
        return out


class EarlyExitNet(nn.Module):
    def __init__(self, d: int = 48, n_layer: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(EarlyExitBlock(d) for _ in range(n_layer))
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        exits = torch.stack([block.exit_logits for block in self.blocks]).mean(0)
        return self.head(x) + 0.5 * exits  # (the loss function sees the exits through the logits)


class PaddedEncoder(nn.Module):
    """Token classifier over ``nn.TransformerEncoder`` with a key padding mask (token 0 pads)."""

    def __init__(self, d: int = 16, n_layer: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, d)
        layer = nn.TransformerEncoderLayer(d, 2, 2 * d, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, n_layer)
        self.head = nn.Linear(d, 10)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pad = idx == 0
        h = self.encoder(self.emb(idx), src_key_padding_mask=pad)
        return self.head(h.masked_fill(pad[..., None], 0.0).sum(1) / (~pad).sum(1, keepdim=True))


@dataclasses.dataclass(frozen=True)
class Spec:
    build: Callable[[], nn.Module]
    inputs: str  # "features": (B, 48) floats; "ids": (B, 10) integers; "padded": ids, right-/left-padded by rank
    predict_calls: int = 1
    weight_decay: float = 0.1
    clip: float | None = CLIP


SPECS = {
    "dataclass_blocks": Spec(DataclassBlocksNet, "features"),
    "kept_exit_logits": Spec(EarlyExitNet, "features"),
    "padded_encoder": Spec(PaddedEncoder, "padded", predict_calls=2),
    "sparse_embedding": Spec(SparseEmbeddingNet, "ids", weight_decay=0.0, clip=None),
}


def make_batches(name: str, n: int, global_batch: int, seed: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        if SPECS[name].inputs == "ids":
            x = torch.randint(0, 500, (global_batch, 10), generator=g)
        elif SPECS[name].inputs == "padded":  # the first half of the rows (rank 0) padded on the right, then left
            x = torch.randint(1, 64, (global_batch, 10), generator=g)
            x[: global_batch // 2, -3:] = 0
            x[global_batch // 2 :, :3] = 0
        else:
            x = torch.randn(global_batch, 48, generator=g)
        out.append((x, torch.randint(0, 10, (global_batch,), generator=g)))
    return out


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return SPECS[name].build()


def sgd(name: str, params: Any) -> torch.optim.Optimizer:
    # SGD with momentum and weight decay: AdamW would amplify rounding noise on parameters whose gradient is zero
    # in exact arithmetic (an attention key bias), and weight decay still tells a zero gradient from none.
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=SPECS[name].weight_decay)


# ---------------------------------------------------------------- through Lightning
class ClassifierModule(pl.LightningModule):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.net = build(name)
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.losses.append(float(loss.detach()))
        return loss

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return torch.stack([self.net(batch[0]) for _ in range(SPECS[self.name].predict_calls)]).mean(0)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return sgd(self.name, self.parameters())


def _fit(rank: int, world: int, name: str, root: str) -> dict[str, Any]:
    from zlightning.strategies import ZStackZero3Strategy

    import zlightning  # noqa: F401  (registers zstack_zero3)
    from zlightning.zero import ZeroConfig, full_state_dict

    torch.set_num_threads(1)
    data = [(x.chunk(world)[rank], y.chunk(world)[rank]) for x, y in make_batches(name, MICRO_BATCHES, 2 * world)]
    pl.seed_everything(0, verbose=False)
    module = ClassifierModule(name)
    trainer = pl.Trainer(
        strategy=ZStackZero3Strategy(ZeroConfig(param_persistence_threshold=0)),  # every parameter sharded
        accelerator="cpu",
        devices=world,
        max_epochs=2,
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=SPECS[name].clip,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        default_root_dir=root,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader(data, batch_size=None))
    predictions = torch.cat(trainer.predict(module, DataLoader(data, batch_size=None)))  # type: ignore[arg-type]
    losses = torch.tensor(module.losses)
    dist.all_reduce(losses)
    return {
        "losses": (losses / world).tolist(),
        "state": {k.removeprefix("net."): v.clone() for k, v in full_state_dict(module).items()},
        "predictions": predictions,
        "kept_warnings": sorted({str(w.message).split("'")[1] for w in caught if "stays gathered" in str(w.message)}),
    }


def reference(name: str) -> tuple[nn.Module, list[float], list[torch.Tensor]]:
    """One process on the global batches, two epochs as the fit runs; each rank's predictions after training."""
    model = build(name)
    opt = sgd(name, model.parameters())
    losses = []
    data = make_batches(name, MICRO_BATCHES, 2 * WORLD)
    clip = SPECS[name].clip
    for _ in range(2):
        for i, (x, y) in enumerate(data):
            loss = F.cross_entropy(model(x), y)
            losses.append(float(loss.detach()))
            (loss / ACCUMULATE).backward()
            if (i + 1) % ACCUMULATE == 0:
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                opt.step()
                opt.zero_grad()
    with torch.no_grad():
        predictions = [torch.cat([model(x.chunk(WORLD)[r]) for x, _ in data]) for r in range(WORLD)]
    return model, losses, predictions


def assert_matches_one_process(name: str, out: list[dict[str, Any]]) -> None:
    model, losses, predictions = reference(name)
    for rank, rank_out in enumerate(out):
        torch.testing.assert_close(rank_out["losses"], losses, rtol=1e-5, atol=1e-6)
        for key, value in model.state_dict().items():
            torch.testing.assert_close(rank_out["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)
        torch.testing.assert_close(rank_out["predictions"], predictions[rank], rtol=1e-5, atol=1e-5)


def test_blocks_returning_a_dataclass_or_an_opaque_object_train_as_one_process(tmp_path: Any) -> None:
    out = run_distributed(_fit, WORLD, "dataclass_blocks", str(tmp_path), init_process_group=False, timeout=300)
    assert_matches_one_process("dataclass_blocks", out)
    # the dataclass blocks are released after their forward; the opaque one is kept, and the user is told
    assert out[0]["kept_warnings"] == ["net.blocks.2"], out[0]["kept_warnings"]


def test_a_result_kept_on_a_block_for_the_model_trains_as_one_process(tmp_path: Any) -> None:
    out = run_distributed(_fit, WORLD, "kept_exit_logits", str(tmp_path), init_process_group=False, timeout=300)
    assert_matches_one_process("kept_exit_logits", out)
    assert out[0]["kept_warnings"] == [], out[0]["kept_warnings"]  # the blocks are released after their forward


def test_a_transformer_encoder_predicts_twice_per_step_on_ranks_padded_on_different_sides(tmp_path: Any) -> None:
    out = run_distributed(_fit, WORLD, "padded_encoder", str(tmp_path), init_process_group=False, timeout=300)
    assert_matches_one_process("padded_encoder", out)


def test_a_sparse_embedding_trains_with_sgd_as_one_process(tmp_path: Any) -> None:
    out = run_distributed(_fit, WORLD, "sparse_embedding", str(tmp_path), init_process_group=False, timeout=300)
    assert_matches_one_process("sparse_embedding", out)
