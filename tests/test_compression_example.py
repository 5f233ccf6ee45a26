"""examples/gpt_compression.yaml runs through the zlightning command: three callbacks, TensorBoard scalars, export."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml

from examples.gpt import GPTLightningModule
from zlightning.cli import main
from zlightning.compression import load_compressed

CONFIG = Path(__file__).resolve().parent.parent / "examples" / "gpt_compression.yaml"


def test_example_config_trains_logs_and_exports(tmp_path: Path) -> None:
    config = yaml.safe_load(CONFIG.read_text())
    trainer, callbacks = config["trainer"], config["trainer"]["callbacks"]
    trainer.update(
        max_steps=3, val_check_interval=2, limit_val_batches=1, log_every_n_steps=1, enable_progress_bar=False
    )
    trainer["logger"]["init_args"]["save_dir"] = str(tmp_path)
    callbacks[0]["init_args"]["export_path"] = str(tmp_path / "gpt.zlc")
    for callback in callbacks[1:]:
        callback["init_args"]["schedule_offset"] = 1
    config["model"]["init_args"]["d_model"] = 64
    config["data"]["init_args"]["max_bytes"] = 200_000
    small = tmp_path / "small.yaml"
    small.write_text(yaml.safe_dump(config))
    main(["fit", "--config", str(small)])
    events = list(tmp_path.glob("gpt_compression/version_*/events.out.tfevents.*"))
    assert events
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    assert {
        "compression/weight_quantization/bits",
        "compression/row_pruning/masked_fraction",
        "compression/sparse_pruning/masked_fraction",
    } <= set(acc.Tags()["scalars"])
    model = GPTLightningModule(**{**config["model"]["init_args"]})
    load_compressed(tmp_path / "gpt.zlc", model)
    mlp = model.model.blocks[0].mlp
    assert mlp.fc.out_features == mlp.proj.in_features == 128  # half of the 4 * 64 MLP rows, removed
    assert float((model.model.blocks[0].attn.qkv.weight == 0).float().mean()) >= 0.5
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(0, 256, (1, 8)))).all()
