"""Export that really shrinks: packed int8/int4 codes + scales, loadable back into a working model."""

import pytest
import torch

from examples.gpt_model import GPT, GPTConfig
from zlightning.compression import (
    CompressionConfig,
    PruneGroup,
    RowPruningConfig,
    SparsePruningConfig,
    WeightQuantGroup,
    WeightQuantizationConfig,
    apply_schedule,
    init_compression,
    load_compressed,
    save_compressed,
)

CFG = GPTConfig(d_model=128, n_head=4, n_layer=2, seq_len=16)


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


@pytest.mark.parametrize("bits,min_ratio", [(8, 3.5), (4, 6.0)])
@pytest.mark.parametrize("scheme", ["symmetric", "asymmetric"])
def test_int_export_shrinks_and_round_trips(tmp_path, bits: int, min_ratio: float, scheme: str) -> None:
    model = _gpt()
    x = torch.randint(0, 256, (2, 16))
    wq = WeightQuantizationConfig(
        schedule_offset=0,
        quantization_type=scheme,
        quantize_groups=4,
        groups=(WeightQuantGroup(start_bits=bits, target_bits=bits),),
    )
    init_compression(model, CompressionConfig(weight_quantization=wq))
    apply_schedule(model, 0)
    with torch.no_grad():
        fake = model(x)[0]
        report = save_compressed(model, tmp_path / "m.zlc")
    assert report.file_bytes == (tmp_path / "m.zlc").stat().st_size
    assert report.ratio >= min_ratio, report
    assert "tok_emb.weight" in report.quantized and "head.weight" not in report.quantized  # tied: stored once
    loaded = load_compressed(tmp_path / "m.zlc", GPT(CFG))
    assert loaded.head.weight is loaded.tok_emb.weight
    with torch.no_grad():
        assert torch.equal(loaded(x)[0], fake)  # bit-identical to the training forward's fake quantization


def test_export_after_structured_pruning_loads_into_fresh_model(tmp_path) -> None:
    model = _gpt()
    x = torch.randint(0, 256, (2, 16))
    cfg = CompressionConfig(
        weight_quantization=WeightQuantizationConfig(
            schedule_offset=0, quantize_groups=128, groups=(WeightQuantGroup(modules=(r"mlp\.",)),)
        ),
        sparse_pruning=SparsePruningConfig(schedule_offset=0, groups=(PruneGroup(name="s", modules=(r"attn\.qkv$",)),)),
        row_pruning=RowPruningConfig(
            schedule_offset=0,
            groups=(
                PruneGroup(name="r", modules=(r"mlp\.fc$",), dense_ratio=0.25, related_modules=((r"mlp\.proj$",),)),
            ),
        ),
    )
    init_compression(model, cfg)
    apply_schedule(model, 0)
    with torch.no_grad():
        compressed = model(x)[0]
        save_compressed(model, tmp_path / "m.zlc")
    fresh = GPT(CFG)
    load_compressed(tmp_path / "m.zlc", fresh)
    assert fresh.blocks[0].mlp.fc.out_features == 128 and fresh.blocks[0].mlp.proj.in_features == 128
    with torch.no_grad():
        torch.testing.assert_close(fresh(x)[0], compressed, rtol=1e-5, atol=1e-5)


def test_load_rejects_other_files(tmp_path) -> None:
    torch.save({"a": torch.ones(1)}, tmp_path / "x.pt")
    with pytest.raises(ValueError, match="not a zlightning compressed export"):
        load_compressed(tmp_path / "x.pt", _gpt())


def test_stochastic_rounding_trains_noisy_but_exports_nearest(tmp_path) -> None:
    model = _gpt()
    x = torch.randint(0, 256, (2, 16))
    wq = WeightQuantizationConfig(
        schedule_offset=0, rounding="stochastic", groups=(WeightQuantGroup(start_bits=4, target_bits=4),)
    )
    init_compression(model, CompressionConfig(weight_quantization=wq))
    apply_schedule(model, 0)
    fc = model.blocks[0].mlp.fc
    with torch.no_grad():
        assert not torch.equal(fc.compressed_weight(), fc.compressed_weight())  # training: stochastic rounding
        model.eval()
        nearest = model(x)[0]  # eval: round to nearest
        model.train()
        save_compressed(model, tmp_path / "m.zlc")  # bakes with nearest rounding, in train mode too
        assert torch.equal(model(x)[0], nearest)
        assert torch.equal(load_compressed(tmp_path / "m.zlc", GPT(CFG))(x)[0], nearest)
