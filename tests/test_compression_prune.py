"""Masks (ceil(dense_ratio*N) kept, straight-through scores), schedule offsets, and clean-up equivalence."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zlightning.compression import (
    ChannelPruningConfig,
    CompressionConfig,
    HeadPruningConfig,
    LayerReductionConfig,
    PruneGroup,
    RowPruningConfig,
    SparsePruningConfig,
    WeightQuantGroup,
    WeightQuantizationConfig,
    apply_schedule,
    init_compression,
    reduce_layers,
    redundancy_clean,
)
from zlightning.compression._techniques import topk_mask


class Attention(nn.Module):
    """Fused-QKV attention that reads its widths from its layers, so it keeps working after heads are removed."""

    def __init__(self, d: int = 24, n_head: int = 4) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        inner = self.qkv.out_features // 3
        q, k, v = (t.view(B, T, self.n_head, inner // self.n_head).transpose(1, 2) for t in self.qkv(x).split(inner, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, inner))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention()
        self.fc = nn.Linear(24, 40)
        self.out = nn.Linear(40, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.out(F.gelu(self.fc(x)))


class Stack(nn.Module):
    def __init__(self, n: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _x() -> torch.Tensor:
    return torch.randn(2, 5, 24, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("ratio", [0.1, 0.33, 0.5, 0.77, 1.0])
def test_topk_mask_keeps_ceil_and_passes_gradient(ratio: float) -> None:
    scores = torch.randn(7, 13, requires_grad=True)
    m = topk_mask(scores, ratio)
    assert int(m.sum()) == math.ceil(ratio * scores.numel())
    assert bool((scores[m.bool()].min() >= scores[~m.bool()].max()) if ratio < 1 else True)
    upstream = torch.randn(7, 13)
    (m * upstream).sum().backward()
    assert torch.equal(scores.grad, upstream)


@pytest.mark.parametrize("technique,ratio,units", [("sparse", 0.3, 40 * 24), ("row", 0.3, 40), ("head", 0.5, 4)])
@pytest.mark.parametrize("method", ["l1", "topk"])
def test_masks_keep_ceil_dense_ratio(technique: str, ratio: float, units: int, method: str) -> None:
    pattern = r"attn\.proj$" if technique == "head" else r"\.fc$"
    group = (PruneGroup(name="g", modules=(pattern,), dense_ratio=ratio),)
    kind = {"sparse": SparsePruningConfig, "row": RowPruningConfig, "head": HeadPruningConfig}[technique]
    model = init_compression(
        Stack(), CompressionConfig(**{f"{technique}_pruning": kind(groups=group, method=method, schedule_offset=0)})
    )
    apply_schedule(model, 0)
    model(_x())
    for block in model.blocks:
        layer = block.attn.proj if technique == "head" else block.fc
        mask = getattr(layer, f"{technique}_pruning").mask
        assert mask.numel() == units and int(mask.sum()) == math.ceil(ratio * units)


def test_l1_mask_keeps_largest_and_is_computed_at_start() -> None:
    model = init_compression(
        Stack(1),
        CompressionConfig(
            sparse_pruning=SparsePruningConfig(
                groups=(PruneGroup(name="g", modules=(r"\.fc$",), dense_ratio=0.25),), schedule_offset=3
            )
        ),
    )
    fc = model.blocks[0].fc
    with torch.no_grad():
        fc.weight.mul_(2)  # the weights change before the offset: the mask must follow the weights at the offset
    apply_schedule(model, 3)
    model(_x())
    kept = fc.weight.abs()[fc.sparse_pruning.mask.bool()]
    dropped = fc.weight.abs()[~fc.sparse_pruning.mask.bool()]
    assert kept.min() >= dropped.max()


@pytest.mark.parametrize("offset", [0, 2, 100])
def test_bit_identical_before_offset_and_on_after(offset: int) -> None:
    ref = Stack()
    model = Stack()
    model.load_state_dict(ref.state_dict())
    cfg = CompressionConfig(
        weight_quantization=WeightQuantizationConfig(
            schedule_offset=offset, groups=(WeightQuantGroup(target_bits=4, start_bits=4),)
        ),
        sparse_pruning=SparsePruningConfig(
            schedule_offset=offset, groups=(PruneGroup(name="s", modules=(r"\.out$",)),)
        ),
    )
    init_compression(model, cfg)
    x = _x()
    for step in range(4):
        apply_schedule(model, step)
        for mode in (True, False):
            model.train(mode), ref.train(mode)
            same = torch.equal(model(x), ref(x))
            assert same == (step < offset), (step, mode)


def test_topk_scores_are_parameters_learn_and_leave_state_dict_after_clean() -> None:
    model = init_compression(
        Stack(1),
        CompressionConfig(
            row_pruning=RowPruningConfig(
                method="topk", schedule_offset=0, groups=(PruneGroup(name="r", modules=(r"\.fc$",), dense_ratio=0.5),)
            )
        ),
    )
    scores = model.blocks[0].fc.row_pruning.scores
    assert any(p is scores for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    apply_schedule(model, 0)
    before = scores.detach().clone()
    model(_x()).square().mean().backward()
    assert scores.grad is not None and scores.grad.abs().sum() > 0
    opt.step()
    assert not torch.equal(before, scores.detach())
    assert any("row_pruning.scores" in k for k in model.state_dict())
    redundancy_clean(model)
    assert not any("row_pruning" in k for k in model.state_dict())


def _compress_and_clean(
    cfg: CompressionConfig, model: nn.Module, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, nn.Module]:
    init_compression(model, cfg)
    apply_schedule(model, 10)
    with torch.no_grad():
        masked = model(x)
        redundancy_clean(model)
        cleaned = model(x)
    return masked, cleaned, model


def test_row_pruning_clean_removes_rows_and_keeps_outputs() -> None:
    cfg = CompressionConfig(
        row_pruning=RowPruningConfig(
            schedule_offset=0,
            groups=(PruneGroup(name="r", modules=(r"\.fc$",), dense_ratio=0.3, related_modules=((r"\.out$",),)),),
        )
    )
    masked, cleaned, model = _compress_and_clean(cfg, Stack(), _x())
    kept = math.ceil(0.3 * 40)
    for block in model.blocks:
        assert type(block.fc) is nn.Linear and block.fc.out_features == block.out.in_features == kept
        assert block.fc.weight.shape == (kept, 24) and block.out.weight.shape == (24, kept)
    torch.testing.assert_close(cleaned, masked, rtol=1e-5, atol=1e-5)


def test_head_pruning_clean_updates_head_count_and_keeps_outputs() -> None:
    """Upstream bug: head pruning left the head count (and in/out features) stale."""
    cfg = CompressionConfig(
        head_pruning=HeadPruningConfig(
            schedule_offset=0,
            method="l1",
            groups=(
                PruneGroup(name="h", modules=(r"attn\.proj$",), dense_ratio=0.5, related_modules=((r"attn\.qkv$",),)),
            ),
        )
    )
    masked, cleaned, model = _compress_and_clean(cfg, Stack(), _x())
    for block in model.blocks:
        attn = block.attn
        assert attn.n_head == 2
        assert attn.proj.in_features == 12 and attn.qkv.out_features == 36
    torch.testing.assert_close(cleaned, masked, rtol=1e-5, atol=1e-5)


def test_head_pruning_removes_heads_from_the_example_gpt() -> None:
    from examples.gpt_model import GPT, GPTConfig

    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layer=2, n_head=4, bias=True))
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    cfg = CompressionConfig(
        head_pruning=HeadPruningConfig(
            schedule_offset=0,
            method="l1",
            groups=(
                PruneGroup(name="h", modules=(r"attn\.proj$",), dense_ratio=0.5, related_modules=((r"attn\.qkv$",),)),
            ),
        )
    )
    masked, cleaned, model = _compress_and_clean(cfg, gpt, idx)
    for block in model.blocks:
        assert block.attn.n_head == 2
        assert block.attn.proj.in_features == 16 and block.attn.qkv.out_features == 48
    torch.testing.assert_close(cleaned, masked, rtol=1e-5, atol=1e-5)


def test_head_count_needed() -> None:
    class NoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)

    with pytest.raises(ValueError, match="cannot tell the head count"):
        init_compression(NoHeads(), CompressionConfig(head_pruning=HeadPruningConfig()))
    model = init_compression(NoHeads(), CompressionConfig(head_pruning=HeadPruningConfig(num_heads=2)))
    assert model.proj.head_pruning.num_heads == 2


def test_channel_pruning_with_conv_and_batchnorm() -> None:
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3))
    with torch.no_grad():
        net[1].running_mean.uniform_(-1, 1)
        net[1].running_var.uniform_(0.5, 2)
    net.eval()
    cfg = CompressionConfig(
        channel_pruning=ChannelPruningConfig(
            schedule_offset=0,
            groups=(PruneGroup(name="c", modules=(r"^0$",), dense_ratio=0.5, related_modules=((r"^1$", r"^3$"),)),),
        )
    )
    init_compression(net, cfg)
    apply_schedule(net, 0)
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        masked = net(x)
        redundancy_clean(net)
        cleaned = net(x)
    assert net[0].out_channels == 4 and net[1].num_features == 4 and net[3].in_channels == 4
    # BN shifts pruned channels by its bias, so outputs change (as DeepSpeed documents); without BN they match
    assert cleaned.shape == masked.shape
    plain = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3))
    init_compression(
        plain,
        CompressionConfig(
            channel_pruning=ChannelPruningConfig(
                schedule_offset=0,
                groups=(PruneGroup(name="c", modules=(r"^0$",), dense_ratio=0.5, related_modules=((r"^2$",),)),),
            )
        ),
    )
    apply_schedule(plain, 0)
    with torch.no_grad():
        masked = plain(x)
        redundancy_clean(plain)
        torch.testing.assert_close(plain(x), masked, rtol=1e-5, atol=1e-5)
    assert plain[0].out_channels == 4 and plain[2].in_channels == 4


def test_weight_quant_clean_bakes_grid_values() -> None:
    cfg = CompressionConfig(
        weight_quantization=WeightQuantizationConfig(
            schedule_offset=0,
            quantize_groups=40,
            groups=(WeightQuantGroup(modules=(r"\.fc$",), start_bits=4, target_bits=4),),
        )
    )
    masked, cleaned, model = _compress_and_clean(cfg, Stack(1), _x())
    assert torch.equal(cleaned, masked)
    for row in model.blocks[0].fc.weight:
        assert row.unique().numel() <= 16


def test_inactive_techniques_dropped_with_warning() -> None:
    model = init_compression(Stack(1), CompressionConfig(sparse_pruning=SparsePruningConfig(schedule_offset=50)))
    apply_schedule(model, 3)
    ref = model(_x())
    with pytest.warns(UserWarning, match="schedule has not started"):
        redundancy_clean(model)
    assert torch.equal(model(_x()), ref)


def test_layer_reduction_copies_teacher_layers() -> None:
    teacher, student = Stack(4), Stack(2)
    reduce_layers(student, teacher, LayerReductionConfig(module_name_prefix="blocks", teacher_layer=(1, 3)))
    for i, t in enumerate((1, 3)):
        for a, b in zip(student.blocks[i].parameters(), teacher.blocks[t].parameters()):
            assert torch.equal(a, b)
    with pytest.raises(ValueError, match="student has 2 layers"):
        reduce_layers(student, teacher, LayerReductionConfig(module_name_prefix="blocks", teacher_layer=(0, 1, 2)))
    with pytest.raises(ValueError, match="no teacher_model"):
        init_compression(
            student,
            CompressionConfig(layer_reduction=LayerReductionConfig(module_name_prefix="blocks", teacher_layer=(0, 1))),
        )
