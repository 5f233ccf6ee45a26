"""Config parsing (DeepSpeed compression_training), module selection, and the upstream bugs it avoids."""

import ast
import dataclasses
import inspect
import json

import pytest
import torch
from torch import nn

import zlightning.compression._config as config_module
from zlightning.compression import (
    CompressionConfig,
    PruneGroup,
    SparsePruningConfig,
    UnknownCompressionKeysError,
    apply_schedule,
    compression_stats,
    init_compression,
    redundancy_clean,
)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc2(torch.relu(self.fc1(self.emb(idx)))))


def _ds(**techniques: dict) -> dict:
    return {"compression_training": techniques}


WQ = {
    "shared_parameters": {"enabled": True, "schedule_offset": 0, "quantize_groups": 1},
    "different_groups": {"wq1": {"params": {"start_bits": 8, "target_bits": 8}}},
}


def test_deepspeed_dict_and_json_path(tmp_path) -> None:
    ds = _ds(
        weight_quantization=WQ,
        sparse_pruning={
            "shared_parameters": {"enabled": True, "method": "topk", "schedule_offset": 3},
            "different_groups": {"sp1": {"params": {"dense_ratio": 0.25}, "modules": ["fc1"]}},
        },
    )
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, **ds}))
    for source in (ds, ds["compression_training"], str(path)):
        cfg = CompressionConfig.from_deepspeed(source)
        assert cfg.weight_quantization.groups[0].target_bits == 8
        assert cfg.sparse_pruning.method == "topk" and cfg.sparse_pruning.schedule_offset == 3
        assert cfg.sparse_pruning.groups[0].modules == ("fc1",) and cfg.sparse_pruning.groups[0].dense_ratio == 0.25
        assert cfg.row_pruning is None


def test_duplicate_json_keys_rejected(tmp_path) -> None:
    path = tmp_path / "dup.json"
    path.write_text('{"compression_training": {"weight_quantization": {}, "weight_quantization": {}}}')
    with pytest.raises(ValueError, match="duplicate keys"):
        CompressionConfig.from_deepspeed(str(path))


def test_unknown_keys_listed_in_one_error() -> None:
    bad = {
        "shared_parameters": {**WQ["shared_parameters"], "schedule_ofset": 5},
        "different_groups": {"wq1": {"params": {"start_bits": 8, "target_bits": 8, "bitz": 4}, "modulez": []}},
    }
    with pytest.raises(UnknownCompressionKeysError) as err:
        CompressionConfig.from_deepspeed(_ds(weight_quantization=bad, row_prunning={}))
    msg = str(err.value)
    for key in (
        "compression_training.row_prunning",
        "weight_quantization.shared_parameters.schedule_ofset",
        "different_groups.wq1.params.bitz",
        "different_groups.wq1.modulez",
    ):
        assert key in msg


def test_missing_required_and_bad_values() -> None:
    no_bits = {"shared_parameters": {"enabled": True}, "different_groups": {"g": {"params": {"start_bits": 8}}}}
    with pytest.raises(ValueError, match="missing required keys \\['target_bits'\\]"):
        CompressionConfig.from_deepspeed(_ds(weight_quantization=no_bits))
    with pytest.raises(ValueError, match="dense_ratio"):
        PruneGroup(dense_ratio=0.0)
    with pytest.raises(ValueError, match="snip_momentum.*not supported"):  # its own keys are known, not "unknown"
        CompressionConfig.from_deepspeed(
            _ds(
                sparse_pruning={
                    "shared_parameters": {
                        "enabled": True,
                        "method": "snip_momentum",
                        "block_pattern": "4x1",
                        "dense_ratio": 0.1,
                    },
                    "different_groups": {},
                }
            )
        )
    with pytest.raises(ValueError, match="no different_groups"):
        CompressionConfig.from_deepspeed(_ds(row_pruning={"shared_parameters": {"enabled": True}}))


def test_documented_defaults_are_the_code_defaults() -> None:
    """Every field docstring states its default, and it is the dataclass default (DeepSpeed's docs and code differed)."""
    tree = ast.parse(inspect.getsource(config_module))
    checked = 0
    for cls_node in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        cls = getattr(config_module, cls_node.name)
        docs = {}
        body = cls_node.body
        for i, node in enumerate(body[:-1]):
            nxt = body[i + 1]
            if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                docs[node.target.id] = nxt.value.value
        for f in dataclasses.fields(cls):
            if f.default is dataclasses.MISSING:
                assert "Required" in docs[f.name], (cls.__name__, f.name)
                continue
            doc = " ".join(docs[f.name].split())
            if isinstance(f.default, (int, float, str)) or f.default is None:
                shown = f'``"{f.default}"``' if isinstance(f.default, str) else f"{f.default}"
                assert f"Default {shown}" in doc, (cls.__name__, f.name, doc)
            else:
                assert "Default" in doc, (cls.__name__, f.name)
            checked += 1
    assert checked > 30
    # DeepSpeed's code defaults, kept and documented (its docs said 0 / "static")
    assert SparsePruningConfig().schedule_offset == 1000
    parsed = CompressionConfig.from_deepspeed(
        _ds(
            sparse_pruning={
                "shared_parameters": {"enabled": True},
                "different_groups": {"g": {"params": {"dense_ratio": 0.5}}},
            }
        )
    )
    assert parsed.sparse_pruning.schedule_offset == SparsePruningConfig().schedule_offset


def test_omitted_modules_means_all_compressible_modules() -> None:
    """Upstream bug: omitted modules became the regex '*' and crashed with re.error."""
    model = init_compression(
        Net(),
        _ds(
            weight_quantization=WQ,
            sparse_pruning={
                "shared_parameters": {"enabled": True, "schedule_offset": 0},
                "different_groups": {"sp1": {"params": {"dense_ratio": 0.5}}},
            },
        ),
    )
    assert model.emb.weight_quantization is not None  # Embedding: weight quantization only
    assert model.fc1.sparse_pruning is not None and model.fc2.sparse_pruning is not None
    assert getattr(model.emb, "sparse_pruning", None) is None
    assert isinstance(model.norm, nn.LayerNorm)


def test_sparse_pruning_past_offset_does_not_raise_keyerror() -> None:
    """Upstream bug: the scheduler raised KeyError('schedule_offset_end') at the first step past the offset."""
    model = init_compression(Net(), CompressionConfig(sparse_pruning=SparsePruningConfig(schedule_offset=2)))
    idx = torch.arange(10)
    for step in range(5):
        apply_schedule(model, step)
        model(idx)
        assert model.fc1.sparse_pruning.active == (step >= 2)
    assert compression_stats(model)["compression/sparse_pruning/masked_fraction"] == pytest.approx(0.5, abs=0.01)


@pytest.mark.parametrize("where", ["two groups", "two patterns", "two calls", "redundancy_clean"])
def test_module_matched_twice_is_a_clear_error(where: str) -> None:
    model = Net()
    if where == "two groups":
        groups = {
            "a": {"params": {"dense_ratio": 0.5}, "modules": ["fc"]},
            "b": {"params": {"dense_ratio": 0.5}, "modules": ["fc2"]},
        }
    else:
        groups = {"a": {"params": {"dense_ratio": 0.5}, "modules": ["fc1", "fc" if where == "two patterns" else "fc2"]}}
    cfg = _ds(sparse_pruning={"shared_parameters": {"enabled": True}, "different_groups": groups})
    if where in ("two groups", "two patterns"):
        with pytest.raises(ValueError, match="fc.* is matched by group .* but is already in group"):
            init_compression(model, cfg)
        assert isinstance(model.fc1, nn.Linear) and getattr(model.fc1, "sparse_pruning", None) is None  # untouched
    elif where == "two calls":
        init_compression(model, cfg)
        with pytest.raises(ValueError, match="already has sparse_pruning"):
            init_compression(model, cfg)
    else:
        init_compression(model, cfg)
        overlapping = {"a": {"params": {"dense_ratio": 0.5}, "modules": ["fc1", "1"]}}
        with pytest.raises(ValueError, match="'fc1' is matched by group"):
            redundancy_clean(
                model, _ds(sparse_pruning={"shared_parameters": {"enabled": True}, "different_groups": overlapping})
            )


def test_wrong_type_and_unmatched_patterns() -> None:
    with pytest.raises(ValueError, match="unsupported type.*emb \\(Embedding\\)"):
        init_compression(
            Net(),
            CompressionConfig(sparse_pruning=SparsePruningConfig(groups=(PruneGroup(name="s", modules=("emb",)),))),
        )
    with pytest.raises(ValueError, match="matches no module"):
        init_compression(
            Net(),
            CompressionConfig(
                sparse_pruning=SparsePruningConfig(groups=(PruneGroup(name="s", modules=("nothing_here",)),))
            ),
        )
    with pytest.raises(ValueError, match="not a valid regex"):
        init_compression(
            Net(), CompressionConfig(sparse_pruning=SparsePruningConfig(groups=(PruneGroup(name="s", modules=("*",)),)))
        )


def test_callback_defaults_are_the_config_defaults() -> None:
    """The callbacks' keyword defaults repeat the typed configs' (DeepSpeed code) defaults, never other values."""
    from zlightning import callbacks
    from zlightning.compression import (
        ActivationQuantGroup,
        ActivationQuantizationConfig,
        ChannelPruningConfig,
        HeadPruningConfig,
        RowPruningConfig,
        WeightQuantGroup,
        WeightQuantizationConfig,
    )

    pairs = {
        callbacks.WeightQuantization: (WeightQuantizationConfig(), WeightQuantGroup()),
        callbacks.ActivationQuantization: (ActivationQuantizationConfig(), ActivationQuantGroup()),
        callbacks.SparsePruning: (SparsePruningConfig(), PruneGroup()),
        callbacks.RowPruning: (RowPruningConfig(), PruneGroup()),
        callbacks.HeadPruning: (HeadPruningConfig(), PruneGroup()),
        callbacks.ChannelPruning: (ChannelPruningConfig(), PruneGroup()),
    }
    checked = 0
    for cls, (cfg, group) in pairs.items():
        for name, param in inspect.signature(cls).parameters.items():
            if param.default is inspect.Parameter.empty or name in ("modules", "start_bits", "related_modules"):
                continue
            source = cfg if hasattr(cfg, name) else group if hasattr(group, name) else None
            if source is None:
                continue
            assert param.default == getattr(source, name), (cls.__name__, name)
            checked += 1
        built = cls()  # defaults only: the config equals the typed default, up to the group name
        technique = next(iter(built.config.techniques().values()))
        assert dataclasses.replace(technique, groups=cfg.groups) == cfg, cls.__name__
    assert checked >= 18
