"""The compression callbacks in real Lightning Trainers: parity of DDP and zstack_zero3 (2 gloo ranks) with a
single-process loop over the core functions, schedule offsets in optimizer steps under gradient accumulation,
TensorBoard logging, export at the end of fit, and layer reduction with distillation."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from tests._lightning_models import TinyGPTModule, global_batches_of, loader, state_after_fit
from tests._zero_models import gpt_loss, tiny_gpt
from zlightning.testing import run_distributed

WORLD = 2
ACCUM = 2
STEPS = 4


def _callbacks(export_path: str | None = None) -> list[pl.Callback]:
    from zlightning.callbacks import RowPruning, SparsePruning, WeightQuantization

    return [
        WeightQuantization(
            r"mlp\.|attn\.qkv", target_bits=4, start_bits=6, quantization_period=1, quantize_groups=4, schedule_offset=1
        ),
        SparsePruning(r"mlp\.fc$", method="topk", dense_ratio=0.5, schedule_offset=2),
        RowPruning(r"attn\.proj$", dense_ratio=0.5, schedule_offset=1, export_path=export_path),
    ]


def _trainer(strategy: str, devices: int, **kwargs: Any) -> pl.Trainer:
    base: dict[str, Any] = dict(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    return pl.Trainer(**{**base, **kwargs})


class _ScoreSizes(pl.Callback):
    """Records how many elements of a learnable score tensor this rank owns (its ZeRO-3 shard, or all under DDP)."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        if engine is None:
            self.sizes.append(pl_module.model.blocks[0].mlp.fc.sparse_pruning.scores.numel())
            return
        owned = [zp.local_numel for zp in engine.params if zp.fqn.endswith("blocks.0.mlp.fc.sparse_pruning.scores")]
        self.sizes.append(sum(owned))


class _BuiltInConfigureModel(TinyGPTModule):
    """The same model built in ``configure_model`` (as ``zstack_zero3`` asks for large models): the callbacks'
    ``setup`` runs before it, when the module has no layers yet."""

    def __init__(self) -> None:
        pl.LightningModule.__init__(self)
        self.model: Any = None
        self.lr = 1e-3
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.model is None:
            self.model = tiny_gpt()


def _module(built: str) -> TinyGPTModule:
    return TinyGPTModule() if built == "init" else _BuiltInConfigureModel()


def _rank_fit(rank: int, world: int, strategy: str, export_path: str, built: str = "init") -> dict[str, Any]:
    from zlightning.strategies import ZStackZero3Strategy

    import zlightning  # noqa: F401  (registers zstack_zero3)
    from zlightning.zero import ZeroConfig

    if strategy == "zstack_zero3":  # shard every parameter, even this tiny model's (no persistent small ones)
        strategy = ZStackZero3Strategy(ZeroConfig(param_persistence_threshold=0))
    pl.seed_everything(0, verbose=False)
    module = _module(built)
    callbacks = _callbacks(export_path)
    sizes = _ScoreSizes()
    trainer = _trainer(strategy, world, max_steps=STEPS, accumulate_grad_batches=ACCUM, callbacks=[*callbacks, sizes])
    trainer.fit(module, loader(STEPS * ACCUM, 2, world))
    report = callbacks[-1].export_report
    return {
        "score_sizes": sizes.sizes,
        "losses": module.losses,
        "state": state_after_fit(module),
        "ratio": None if report is None else report.ratio,
        "step": trainer.global_step,
    }


def _reference() -> tuple[TinyGPTModule, list[float]]:
    """The same training without Lightning: init_compression + apply_schedule(optimizer step) on the global batch."""
    from zlightning.compression import apply_schedule, init_compression

    pl.seed_everything(0, verbose=False)
    module = TinyGPTModule()
    for callback in _callbacks():
        init_compression(module, callback.config)
    opt = module.configure_optimizers()
    assert any(p is module.model.blocks[0].mlp.fc.sparse_pruning.scores for g in opt.param_groups for p in g["params"])
    losses = []
    for i, batch in enumerate(global_batches_of(STEPS * ACCUM, 2, WORLD)[: STEPS * ACCUM]):
        apply_schedule(module, i // ACCUM)
        loss = gpt_loss(module.model, batch)
        losses.append(float(loss.detach()))
        (loss / ACCUM).backward()
        if (i + 1) % ACCUM == 0:
            opt.step()
            opt.zero_grad()
    return module, losses


@pytest.mark.parametrize(
    ("strategy", "built"), [("ddp", "init"), ("zstack_zero3", "init"), ("zstack_zero3", "configure_model")]
)
def test_callbacks_match_single_process_and_export(tmp_path: Any, strategy: str, built: str) -> None:
    from zlightning.compression import load_compressed, redundancy_clean

    path = tmp_path / "gpt.zlc"
    out = run_distributed(_rank_fit, WORLD, strategy, str(path), built, init_process_group=False, timeout=300)
    ref, ref_losses = _reference()
    # each rank saw half of the global batch: the mean of the two ranks' losses is the reference loss
    torch.testing.assert_close(
        [(a + b) / 2 for a, b in zip(out[0]["losses"], out[1]["losses"])], ref_losses, rtol=1e-5, atol=1e-5
    )
    fc = ref.model.blocks[0].mlp.fc
    assert int(fc.sparse_pruning.mask.sum()) == math.ceil(0.5 * fc.weight.numel())
    assert fc.weight_quantization.bits == 4  # 6 bits at offset 1, 5 after 1 step, 4 after 2 more: step 3
    with torch.no_grad():
        x = global_batches_of(1, 2, WORLD)[0][:, :-1]
        compressed = ref.model(x)[0]
        redundancy_clean(ref)  # the callbacks cleaned the ranks' models while exporting
        torch.testing.assert_close(ref.model(x)[0], compressed, rtol=1e-5, atol=1e-5)
    cleaned = ref.state_dict()
    full = ref.model.blocks[0].mlp.fc.weight.numel()
    for r in out:
        assert len(set(r["score_sizes"])) == 1
        assert r["step"] == STEPS and set(r["state"]) == set(cleaned)
        for key, value in cleaned.items():
            torch.testing.assert_close(r["state"][key], value, rtol=1e-5, atol=1e-5, msg=key)
    # scores are partitioned across the ranks like any parameter under ZeRO-3 (each rank owns its slice of the
    # flat shard), replicated under DDP
    assert out[0]["score_sizes"][0] + out[1]["score_sizes"][0] == full * (2 if strategy == "ddp" else 1)
    assert out[0]["ratio"] is not None and out[0]["ratio"] > 1.5 and out[1]["ratio"] is None  # rank 0 writes
    plain = TinyGPTModule()
    load_compressed(path, plain)
    sparsity = float((plain.model.blocks[0].mlp.fc.weight == 0).float().mean())
    assert sparsity >= 0.5
    with torch.no_grad():
        torch.testing.assert_close(plain.model(x)[0], compressed, rtol=1e-4, atol=1e-4)


class _Probe(pl.Callback):
    """Records, at every micro-batch, the global step and whether the techniques are on."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, bool, int]] = []

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        fc = pl_module.model.blocks[0].mlp.fc
        self.seen.append((trainer.global_step, fc.sparse_pruning.active, fc.weight_quantization.bits))


def _scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_offsets_count_optimizer_steps_and_tensorboard_logs(tmp_path: Any) -> None:
    from zlightning.callbacks import SparsePruning, WeightQuantization
    from zlightning.compression import scheduled_bits

    pl.seed_everything(0, verbose=False)
    probe = _Probe()
    callbacks = [
        SparsePruning(r"mlp\.fc$", dense_ratio=0.25, schedule_offset=3),
        WeightQuantization(target_bits=4, start_bits=8, quantization_period=1, schedule_offset=1),
        probe,
    ]
    logger = TensorBoardLogger(str(tmp_path), name="tb", version=0)
    trainer = _trainer(
        "auto", 1, max_steps=8, accumulate_grad_batches=3, callbacks=callbacks, logger=logger, log_every_n_steps=1
    )
    trainer.fit(TinyGPTModule(), loader(24, 2, 1))
    assert len(probe.seen) == 24 and [s for s, _, _ in probe.seen] == [i // 3 for i in range(24)]
    for step, active, bits in probe.seen:
        assert active == (step >= 3)
        assert bits == scheduled_bits(max(0, step - 1), 8, 4, 1)
    logger.experiment.flush()
    scalars = _scalars(logger.log_dir)
    active = dict(scalars["compression/sparse_pruning/active"])
    assert min(active.values()) == 0.0 and max(active.values()) == 1.0
    assert {v for _, v in scalars["compression/sparse_pruning/masked_fraction"]} == {0.75}
    bits = [v for _, v in scalars["compression/weight_quantization/bits"]]
    # 8 bits at offset 1; 7, 6, 5 bits 1, 2 and 4 steps later (the period doubles); 4 bits would need step 9
    assert bits[0] == 8 and bits[-1] == 5 and set(bits) == {8, 7, 6, 5} and bits == sorted(bits, reverse=True)


def test_deepspeed_config_through_the_callback() -> None:
    from zlightning.callbacks import CompressionCallback
    from zlightning.compression import UnknownCompressionKeysError

    ds = {
        "compression_training": {
            "row_pruning": {
                "shared_parameters": {"enabled": True, "schedule_offset": 0, "method": "topk"},
                "different_groups": {
                    "rp1": {
                        "params": {"dense_ratio": 0.5},
                        "modules": [r"mlp\.fc$"],
                        "related_modules": [[r"mlp\.proj$"]],
                    }
                },
            }
        }
    }
    callback = CompressionCallback(ds, clean_at_end=True)
    module = TinyGPTModule()
    _trainer("auto", 1, max_steps=2, callbacks=[callback]).fit(module, loader(2, 2, 1))
    mlp = module.model.blocks[0].mlp
    assert type(mlp.fc) is torch.nn.Linear and mlp.fc.out_features == mlp.proj.in_features == 64  # 128 * 0.5
    with pytest.raises(UnknownCompressionKeysError, match="row_pruning.shared_parameters.dense_ration"):
        CompressionCallback({"row_pruning": {"shared_parameters": {"enabled": True, "dense_ration": 0.5}}})


class _Student(TinyGPTModule):
    def __init__(self, kd: Any) -> None:
        super().__init__(lr=3e-3)
        self.model = tiny_gpt(seed=1, n_layer=2)
        self.kd = kd
        self.kd_losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        idx = batch[0][:, :-1]
        logits, loss = self.model(idx, batch[0][:, 1:])
        kd = self.kd.distillation_loss(logits, idx)
        self.kd_losses.append(float(kd.detach()))
        return 0.0 * loss + kd  # distillation only: it must bring the student towards the teacher


def test_layer_reduction_with_distillation() -> None:
    from zlightning.callbacks import LayerReduction

    teacher = TinyGPTModule()  # same module names as the student: "model.blocks.<i>"
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    kd = LayerReduction(
        teacher,
        module_name_prefix="model.blocks",
        teacher_layer=(0, 2),
        other_module_name=("model.tok_emb", "model.pos_emb", "model.ln_f"),
        distillation_weight=1.0,
        temperature=2.0,
    )
    with pytest.raises(ValueError, match="module_name_prefix"):
        LayerReduction(teacher, module_name_prefix="", teacher_layer=(0,))

    class Check(pl.Callback):
        def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            for i, t in enumerate((0, 2)):
                for a, b in zip(pl_module.model.blocks[i].parameters(), teacher.model.blocks[t].parameters()):
                    assert torch.equal(a, b)
            for name in ("tok_emb", "pos_emb", "ln_f"):
                for a, b in zip(
                    pl_module.model.get_submodule(name).parameters(), teacher.model.get_submodule(name).parameters()
                ):
                    assert torch.equal(a, b)
            self.checked = True

    check = Check()
    student = _Student(kd)
    # the student starts as the teacher without its layer 1: the distillation loss starts small but not zero
    _trainer("auto", 1, max_steps=12, callbacks=[kd, check]).fit(student, loader(12, 4, 1))
    assert check.checked and student.kd_losses[0] > 0
    assert sum(student.kd_losses[-3:]) < sum(student.kd_losses[:3])
    assert all(torch.equal(v, before[k]) for k, v in teacher.state_dict().items())  # the teacher stays frozen
    assert all(p.grad is None for p in teacher.parameters())


@pytest.mark.parametrize("built", ["init", "configure_model"])
def test_resume_restores_masks_scores_and_schedule(tmp_path: Any, built: str) -> None:
    from zlightning.callbacks import RowPruning, SparsePruning

    def fit(epochs: int, ckpt: str | None = None) -> tuple[TinyGPTModule, pl.Trainer]:
        pl.seed_everything(0, verbose=False)
        module = _module(built)
        callbacks = [
            SparsePruning(r"mlp\.fc$", dense_ratio=0.5, schedule_offset=1),
            RowPruning(r"attn\.proj$", method="topk", dense_ratio=0.5, schedule_offset=3),
        ]
        trainer = _trainer("auto", 1, max_epochs=epochs, callbacks=callbacks)
        trainer.fit(module, loader(2, 2, 1), ckpt_path=ckpt)  # 2 steps per epoch: resume at an epoch end
        return module, trainer

    straight, _ = fit(3)
    first, trainer = fit(1)
    trainer.save_checkpoint(tmp_path / "c.ckpt")
    # the l1 mask was fixed at step 1 from the weights then; a mask recomputed after resuming (from the step-2
    # weights) would differ from the straight run's
    assert bool(first.model.blocks[0].mlp.fc.sparse_pruning.ready)
    resumed, trainer = fit(3, str(tmp_path / "c.ckpt"))
    assert trainer.global_step == 6 and resumed.model.blocks[0].attn.proj.row_pruning.active
    expected = straight.state_dict()
    assert any(k.endswith("row_pruning.scores") for k in expected)
    for key, value in resumed.state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=0, msg=key)


def test_a_model_built_in_configure_model_is_reduced_compressed_and_fits_again() -> None:
    from zlightning.callbacks import LayerReduction, SparsePruning

    teacher = TinyGPTModule()
    kd = LayerReduction(teacher, module_name_prefix="model.blocks", teacher_layer=(2, 0, 1))
    prune = SparsePruning(r"mlp\.fc$", dense_ratio=0.5, schedule_offset=0)

    class Check(pl.Callback):
        def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            student, source = pl_module.model.blocks[0], teacher.model.blocks[2]
            self.copied = all(torch.equal(a, b) for a, b in zip(student.parameters(), source.parameters()))
            self.optimized = {id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]}

    check = Check()
    student = _BuiltInConfigureModel()
    assert student.model is None
    _trainer("auto", 1, max_steps=2, callbacks=[kd, prune, check]).fit(student, loader(2, 2, 1))
    fc = student.model.blocks[0].mlp.fc
    assert check.copied  # the layer copy ran after configure_model built the student, before training
    assert id(fc.weight) in check.optimized
    assert int(fc.sparse_pruning.mask.sum()) == fc.weight.numel() // 2  # pruned from the first step
    assert "configure_model" not in student.__dict__  # the one-call wrapper is gone
    # a second fit of the same module: configure_model keeps the built model, nothing is selected twice
    _trainer("auto", 1, max_steps=4, callbacks=[kd, prune]).fit(student, loader(2, 2, 1))
    assert student.model.blocks[0].mlp.fc is fc
