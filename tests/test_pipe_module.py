"""PipelineModule, partitioning, configs and error messages (single process)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from examples.gpt_model import GPT, GPTConfig
from examples.gpt_pipe import gpt_layers, gpt_pipeline, gpt_state_to_pipe
from zlightning.pipe import (
    LayerSpec,
    PipeGrid,
    PipelineConfig,
    PipelineEngine,
    PipelineModule,
    TiedLayerSpec,
    build_schedule,
)
from zlightning.pipe._engine import split_microbatches
from zlightning.pipe._p2p import flatten, unflatten
from zlightning.pipe._partition import partition_balanced, partition_uniform


def test_uniform_partition_matches_deepspeed() -> None:
    assert partition_uniform(10, 4) == [0, 3, 6, 8, 10]
    assert partition_uniform(4, 4) == [0, 1, 2, 3, 4]


def test_balanced_partition_minimises_the_heaviest_stage() -> None:
    assert partition_balanced([1, 1, 1, 1], 2) == [0, 2, 4]
    assert partition_balanced([5, 1, 1, 1, 1, 1], 2) == [0, 1, 6]
    assert partition_balanced([1, 2, 3, 4, 5, 6, 7, 8, 9], 3) == [0, 5, 7, 9]  # parts 15, 13, 17: max 17 optimal
    with pytest.raises(ValueError, match="cannot split 2 layers into 3"):
        partition_balanced([1, 1], 3)


def test_partition_methods_on_gpt() -> None:
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layer=4, n_head=4)
    by_type = gpt_pipeline(cfg, partition_method="type:block").partition(2)
    assert by_type == [0, 4, 8]  # embed, positions, 2 blocks | 2 blocks, norm, head
    by_params = gpt_pipeline(cfg, partition_method="parameters").partition(2)
    assert by_params[0] == 0 and by_params[-1] == 8
    assert gpt_pipeline(cfg, partition_method="uniform").partition(3) == [0, 3, 6, 8]
    with pytest.raises(ValueError, match="matches no layer.*Block"):
        gpt_pipeline(cfg, partition_method="type:Conv2d").partition(2)
    with pytest.raises(ValueError, match="8 layers, which cannot be split into 9 stages"):
        gpt_pipeline(cfg).partition(9)
    with pytest.raises(ValueError, match="unknown partition_method"):
        gpt_pipeline(cfg, partition_method="balanced")
    with pytest.raises(NotImplementedError, match=r"partition_method='profile' is not implemented; use 'parameters'"):
        gpt_pipeline(cfg, partition_method="profile")


class Counter(nn.Linear):
    built = 0

    def __init__(self, d: int) -> None:
        super().__init__(d, d)
        if not self.weight.is_meta:  # counting parameters builds on the meta device (free)
            type(self).built += 1


def test_lazy_build_materialises_only_local_layers() -> None:
    Counter.built = 0
    module = PipelineModule([LayerSpec(Counter, 4) for _ in range(6)], num_stages=3, partition_method="parameters")
    bounds = module.partition(3)
    assert Counter.built == 0 and bounds == [0, 2, 4, 6]  # nothing real is built to count parameters
    module.build(stages=(1,), total_stages=3)
    assert Counter.built == 2
    assert sorted(n for n, _ in module.named_parameters()) == ["2.bias", "2.weight", "3.bias", "3.weight"]
    with pytest.raises(RuntimeError, match="holds stages"):
        module(torch.zeros(1, 4))


def test_seeded_layers_do_not_depend_on_the_split() -> None:
    cfg = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layer=2, n_head=2)
    whole = gpt_pipeline(cfg).build()
    part = gpt_pipeline(cfg).build(stages=(1,), total_stages=2)
    torch.manual_seed(123)  # global RNG state must not matter
    for name, value in part.state_dict().items():
        torch.testing.assert_close(value, whole.state_dict()[name], rtol=0, atol=0)


def test_one_stage_module_equals_plain_gpt() -> None:
    """The recipe is the example GPT: same logits and loss after mapping its weights."""
    cfg = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layer=2, n_head=2, bias=False)
    torch.manual_seed(0)
    gpt = GPT(cfg)
    pipe = gpt_pipeline(cfg).build()
    pipe.load_state_dict(gpt_state_to_pipe(gpt.state_dict(), cfg))
    ids = torch.randint(0, 32, (3, 9))
    logits, loss = gpt(ids[:, :-1], ids[:, 1:])
    torch.testing.assert_close(pipe(ids[:, :-1]), logits)
    torch.testing.assert_close(pipe.batch_loss((ids[:, :-1], ids[:, 1:])), loss)
    assert len(gpt_layers(cfg)) == cfg.n_layer + 4


def test_activation_checkpointing_gives_same_gradients() -> None:
    cfg = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layer=3, n_head=2)
    ids = torch.randint(0, 32, (2, 9))
    grads = []
    for interval in (0, 2):
        m = gpt_pipeline(cfg, activation_checkpoint_interval=interval).build()
        m.batch_loss((ids[:, :-1], ids[:, 1:])).backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, msg=name)


def test_single_process_engine_and_errors() -> None:
    module = PipelineModule(
        [LayerSpec(nn.Linear, 4, 4), lambda x: x * 2, LayerSpec(nn.Linear, 4, 1)], loss_fn=nn.functional.mse_loss
    )
    engine = PipelineEngine(module, lambda ps: torch.optim.SGD(ps, lr=0.1), PipelineConfig(micro_batches=2))
    x, y = torch.randn(4, 4), torch.randn(4, 1)
    ref = PipelineModule(
        [LayerSpec(nn.Linear, 4, 4), lambda x: x * 2, LayerSpec(nn.Linear, 4, 1)], loss_fn=nn.functional.mse_loss
    ).build()
    expected = nn.functional.mse_loss(ref(x), y)
    torch.testing.assert_close(engine.train_batch(batch=(x, y)), expected.detach())
    expected.backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad
    for name, p in module.named_parameters():
        torch.testing.assert_close(p, ref.get_parameter(name), msg=name)
    with pytest.raises(ValueError, match="tensor #0.*micro_batches=2"):
        engine.train_batch(batch=(torch.randn(3, 4), torch.randn(3, 1)))
    with pytest.raises(ValueError, match="pair \\(inputs, labels\\)"):
        engine.train_batch(batch=x)
    with pytest.raises(ValueError, match="ran out after 1"):
        engine.train_batch(iter([(x[:2], y[:2])]))
    with pytest.raises(RuntimeError, match="stage 0 \\(layers 0..2\\).*input\\[0\\]: float32\\[2, 5\\]"):
        engine.train_batch(batch=(torch.randn(4, 5), y))
    with pytest.raises(RuntimeError, match="no forward"):
        engine.forward(x)


def test_loss_must_be_scalar() -> None:
    module = PipelineModule([LayerSpec(nn.Linear, 4, 2)])
    module(torch.zeros(1, 4))  # builds its single stage on first use (no pipeline engine claimed it)
    assert module.is_built
    with pytest.raises(ValueError, match="scalar tensor, got a tensor of shape \\(3, 2\\).*loss_fn="):
        module.batch_loss((torch.zeros(3, 4), None))


def test_config_and_constructor_errors() -> None:
    assert PipelineConfig(zero_stage=3).zero_stage == 3  # ZeRO-3 inside stages (tests/test_pipe_zero3.py)
    with pytest.raises(ValueError, match="zero_stage must be 0, 1, 2 or 3"):
        PipelineConfig(zero_stage=4)
    assert PipelineConfig(zero_stage=3, schedule="zbv").schedule == "zbv"  # split backwards under ZeRO-2/3 too
    with pytest.raises(ValueError, match="zero_stage=2 with tensor_parallel_size=2 is not supported"):
        PipelineConfig(zero_stage=2, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="virtual_stages=2 needs schedule='interleaved_1f1b'"):
        PipelineConfig(virtual_stages=2)
    with pytest.raises(ValueError, match="micro_batches must be an int >= 1"):
        PipelineConfig(micro_batches=0)
    with pytest.raises(ValueError, match="schedule must be"):
        PipelineConfig(schedule="zb")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_stages=3 must divide the world size 4"):
        PipeGrid.from_world(4, 0, 3)
    with pytest.raises(ValueError, match="layers is empty"):
        PipelineModule([])
    with pytest.raises(ValueError, match="tie key"):
        PipelineModule([TiedLayerSpec("a.b", nn.Linear, 2, 2)])
    with pytest.raises(TypeError, match="nn.Module subclass"):
        LayerSpec(torch.relu)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="micro-batch count to be a multiple.*micro_batches=2"):
        build_schedule("interleaved_1f1b", 2, 1, 2)  # what PipelineEngine(...) raises before touching a process group
    grid = PipeGrid(pp=2, dp=2, rank=3)
    assert (grid.stage, grid.dp_rank, grid.pipe_ranks(1), grid.dp_ranks(0)) == (1, 1, [1, 3], [0, 1])


def test_structures_round_trip_and_split() -> None:
    obj = {"h": torch.ones(4, 2), "extra": (torch.zeros(4), 3, None), "mask": torch.ones(4, dtype=torch.bool)}
    tensors, skeleton = flatten(obj)
    assert len(tensors) == 3
    back = unflatten(tensors, skeleton)
    assert back["extra"][1] == 3 and back["extra"][2] is None and back["mask"].dtype == torch.bool
    parts = split_microbatches(obj, 2)
    assert parts[1]["h"].shape == (2, 2) and parts[0]["extra"][1] == 3


def test_strategy_is_registered_and_validates_arguments() -> None:
    import lightning.pytorch as pl
    from zlightning.strategies import PipelinePrecision, PipelineStrategy

    import zlightning  # noqa: F401  (registers the strategies)

    assert "zstack_pipeline" in pl.strategies.StrategyRegistry
    with pytest.raises(ValueError, match="unknown partition_method 'balanced'"):
        PipelineStrategy(partition="balanced")
    with pytest.raises(ValueError, match="invalid regular expression"):
        PipelineStrategy(partition="type:(")
    with pytest.raises(ValueError, match="either config=PipelineConfig"):
        PipelineStrategy(micro_batches=8, config=PipelineConfig())
    with pytest.raises(ValueError, match="num_stages"):
        PipelineStrategy(num_stages=0)
    with pytest.raises(ValueError, match="'32-true', 'bf16-mixed' or '16-mixed'"):
        PipelinePrecision("16-true")  # type: ignore[arg-type]
    assert PipelinePrecision("16-mixed").precision == "16-mixed"
    with pytest.raises(ValueError, match="loss_scaler must be None or a zlightning.zero.LossScalerConfig"):
        PipelineConfig(loss_scaler={"initial_scale_power": 8})  # type: ignore[arg-type]
    strategy = PipelineStrategy(num_stages=2, micro_batches=8, schedule="gpipe", partition="type:Block")
    assert strategy.config == PipelineConfig(micro_batches=8, schedule="gpipe")


def test_single_process_checkpoint_and_cli_consolidation(tmp_path: Path) -> None:
    from zlightning.cli import EXTRA_COMMANDS
    from zlightning.pipe import consolidate_pipeline_checkpoint, load_pipeline_checkpoint, save_pipeline_checkpoint

    cfg = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layer=2, n_head=2)
    engine = PipelineEngine(
        gpt_pipeline(cfg), lambda ps: torch.optim.AdamW(ps, lr=1e-2), PipelineConfig(micro_batches=2)
    )
    ids = torch.randint(0, 32, (4, 9))
    engine.train_batch(batch=(ids[:, :-1], ids[:, 1:]))
    save_pipeline_checkpoint(engine, tmp_path / "ckpt", client_state={"epoch": 1})
    state = consolidate_pipeline_checkpoint(tmp_path / "ckpt")
    assert state.keys() == engine.module.state_dict().keys()
    EXTRA_COMMANDS["consolidate"]([str(tmp_path / "ckpt"), str(tmp_path / "model.pt")])
    for name, value in torch.load(tmp_path / "model.pt").items():
        torch.testing.assert_close(value, engine.module.state_dict()[name], rtol=0, atol=0, msg=name)
    other = PipelineEngine(PipelineModule([LayerSpec(nn.Linear, 2, 2) for _ in range(4)]))
    with pytest.raises(ValueError, match="holds 6 layers but the PipelineModule has 4"):
        load_pipeline_checkpoint(other, tmp_path / "ckpt")
    # an optimizer file from before parameter names were recorded: same grid loads, another grid says why not
    optim_file = tmp_path / "ckpt" / "optim_pp00_dp00.pt"
    saved = torch.load(optim_file, weights_only=False)
    assert len(saved["param_names"]) == len(list(engine.module.parameters())) and None not in saved["param_names"]
    torch.save(saved["optimizer"], optim_file)
    again = PipelineEngine(
        gpt_pipeline(cfg), lambda ps: torch.optim.AdamW(ps, lr=1e-2), PipelineConfig(micro_batches=2)
    )
    load_pipeline_checkpoint(again, tmp_path / "ckpt")
    assert len(again.optimizer.state) == len(engine.optimizer.state) > 0
    meta = torch.load(tmp_path / "ckpt" / "meta.pt", weights_only=True)
    torch.save({**meta, "pp": 2, "bounds": [0, 3, 6]}, tmp_path / "ckpt" / "meta.pt")
    with pytest.raises(ValueError, match="without parameter names .* load_optimizer=False"):
        load_pipeline_checkpoint(again, tmp_path / "ckpt")
    load_pipeline_checkpoint(again, tmp_path / "ckpt", load_optimizer=False)  # weights still load


def test_module_knows_only_its_driver_and_the_stage_runs_with_its_context() -> None:
    """The engine drives a ``PipelineStage``; the module only routes ``batch_loss``/``predict`` to whatever
    ``PipelineDriver`` is registered, and runs its layers in this process without one."""
    layers = [LayerSpec(nn.Linear, 4, 4), LayerSpec(nn.Linear, 4, 1)]
    module = PipelineModule(layers, loss_fn=nn.functional.mse_loss, activation_checkpoint_interval=1)
    engine = PipelineEngine(module, None, PipelineConfig(micro_batches=2))
    assert engine.stage.module is module and engine.stage.chunks == (0,) and engine.p2p is engine.stage.p2p
    x, y = torch.randn(4, 4), torch.randn(4, 1)
    calls: list[str] = []

    class Driver:
        def run_batch(self, batch: object) -> torch.Tensor:
            calls.append("run_batch")
            return torch.zeros(())

        def predict(self, inputs: object) -> object:
            calls.append("predict")
            return inputs

    module.set_driver(Driver())
    module.batch_loss((x, y))
    module.predict(x)
    assert calls == ["run_batch", "predict"]
    module.set_driver(None)
    torch.testing.assert_close(module.batch_loss((x, y)), nn.functional.mse_loss(module(x), y))
    entered: list[int] = []

    class Counting:
        def __enter__(self) -> None:
            entered.append(1)

        def __exit__(self, *exc: object) -> None:
            return None

    module.run_stage(0, x.requires_grad_(), context=Counting).sum().backward()  # checkpointed: entered on recompute
    assert len(entered) == 1 + 2 + 2  # one pass around the blocks, each block's forward and its recomputation


def test_send_thread_holds_no_tensor_and_stop_joins_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: the send thread never frees a tensor]: once a send is issued and drained, only the caller holds the
    tensor (so its last reference never dies in the send thread at interpreter exit), and ``stop`` ends the thread.
    ``dist.isend`` is replaced by a stub: this checks the thread's bookkeeping, not gloo."""
    import weakref

    from zlightning.pipe import _p2p

    monkeypatch.setattr(_p2p.dist, "isend", lambda t, dst, group=None, tag=0: ("work", dst, tag))
    sender = _p2p._Sender(None)
    sent = torch.ones(4)
    alive = weakref.ref(sent)
    sender.submit(sent, 1, 7)
    issued = sender.drain()
    assert [(work, t is sent) for work, t in issued] == [(("work", 1, 7), True)]
    del sent, issued
    assert alive() is None, "the send thread still references the last tensor it sent"
    sender.stop()
    assert not sender.thread.is_alive()
