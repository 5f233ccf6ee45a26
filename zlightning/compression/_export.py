"""Export that really shrinks: quantized weights stored as packed integer codes plus per-row scales.

[Note: export format]
``torch.save`` of a plain dict (loadable with ``weights_only=True``)::

    {"format": "zlightning.compressed.v1",
     "tensors":    {state_dict key: tensor}                  # everything not quantized, original dtype
     "quantized":  {state_dict key: {"packed": uint8 (int16 above 8 bits), "scale": f32 [rows, 1],
                                     "zero_point": f32 [rows, 1] | None, "bits", "scheme", "shape", "dtype",
                                     "offset"}}
     "aliases":    {state_dict key: key it shares storage with}  # tied weights are stored once
     "attributes": {module name: {head-count attribute: int}}}

Codes are packed ``8 // c`` per byte (c = 1, 2, 4 or 8 bits: binary, ternary, int3/int4, int5..int8), so int8 is 4x
and int4 8x smaller than fp32 before scales. Scales are stored per output row (group scales repeated), which stays
valid when rows or columns are removed by cleaning, and the values loaded back are bit-identical to the training
forward's fake-quantized weights (both come from `dequantize`).
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from zlightning._safe_load import load_file
from zlightning.compression._api import HEAD_COUNT_ATTRS, _clean, _root
from zlightning.compression._modules import COMPRESSED_TYPES, TECHNIQUES
from zlightning.compression._quantize import (
    QuantizedWeight,
    pack_codes,
    quantize_weight,
    unpack_codes,
)

__all__ = ["ExportReport", "load_compressed", "save_compressed"]

_FORMAT = "zlightning.compressed.v1"


@dataclass(frozen=True)
class ExportReport:
    """What `save_compressed` wrote."""

    path: Path
    file_bytes: int
    """Size of the written file."""
    float_bytes: int
    """Size of ``torch.save(state_dict)`` of the model before cleaning and quantization (the uncompressed model)."""
    quantized: tuple[str, ...]
    """State-dict keys stored as packed codes."""

    @property
    def ratio(self) -> float:
        """How many times smaller the export is than the uncompressed model."""
        return self.float_bytes / self.file_bytes


def _saved_size(obj: object) -> int:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.tell()


def _per_row(q: QuantizedWeight) -> dict[str, Tensor | None]:
    rows = q.shape[0]
    rep = rows // q.scale.shape[0]
    codes = q.codes.reshape(q.shape)  # weight-shaped, so physical removals can index it
    zp = None if q.zero_point is None else q.zero_point.repeat_interleave(rep, dim=0)
    return {"codes": codes, "scale": q.scale.repeat_interleave(rep, dim=0), "zero_point": zp}


def _row_dequantize(entry: dict, codes: Tensor) -> Tensor:
    c = codes.float().reshape(entry["scale"].shape[0], -1)
    if entry["zero_point"] is not None:
        c = c - entry["zero_point"]
    return (c * entry["scale"]).reshape(entry["shape"]).to(getattr(torch, entry["dtype"]))


def _compact_scales(entry: dict) -> None:
    """Stores one scale per band of equal consecutive rows (``rows_per_scale``) instead of one per row."""
    scale, zp = entry["scale"], entry["zero_point"]
    rows = scale.shape[0]
    for bands in (1, *range(2, rows + 1)):
        if rows % bands:
            continue
        rep = rows // bands
        same = torch.equal(scale.view(bands, rep), scale.view(bands, rep)[:, :1].expand(bands, rep))
        if zp is not None:
            same = same and torch.equal(zp.view(bands, rep), zp.view(bands, rep)[:, :1].expand(bands, rep))
        if same:
            entry["scale"] = scale[::rep].clone()
            entry["zero_point"] = None if zp is None else zp[::rep].clone()
            entry["rows_per_scale"] = rep
            return


def _expand_scales(entry: dict) -> dict:
    rep = entry.get("rows_per_scale", 1)
    if rep == 1:
        return entry
    zp = entry["zero_point"]
    return {
        **entry,
        "scale": entry["scale"].repeat_interleave(rep, dim=0),
        "zero_point": None if zp is None else zp.repeat_interleave(rep, dim=0),
    }


def _quantize_layers(root: nn.Module) -> dict[str, tuple[QuantizedWeight, dict]]:
    out: dict[str, tuple[QuantizedWeight, dict]] = {}
    seen: set[int] = set()
    with torch.no_grad():
        for name, m in root.named_modules():
            wq = getattr(m, "weight_quantization", None) if isinstance(m, COMPRESSED_TYPES) else None
            if wq is None or not wq.active or id(m.weight) in seen:
                continue
            seen.add(id(m.weight))
            q = quantize_weight(m.compressed_weight(quantize=False), wq.bits, wq.scheme, wq.num_groups)
            out[f"{name}.weight" if name else "weight"] = (q, _per_row(q))
    return out


def save_compressed(model: nn.Module, path: str | os.PathLike[str]) -> ExportReport:
    """Cleans ``model`` in place (`redundancy_clean`) and saves it with quantized weights as packed integer codes.

    See [Note: export format]. Layers whose weight quantization is active are stored at their current bits; the rest
    is stored as is. Load with `load_compressed` into a freshly built model of the original architecture.

    Args:
        model: A model prepared by `init_compression` (or a plain model: then nothing is quantized).
        path: Output file.

    Returns:
        An `ExportReport` with the file size and the uncompressed size.
    """
    root = _root(model)
    float_sd = {k: v for k, v in root.state_dict().items() if not any(f".{t}." in f".{k}" for t in TECHNIQUES)}
    float_bytes = _saved_size(float_sd)
    quant = _quantize_layers(root)
    _, edits = _clean(model, None)
    for edit in edits:  # follow the physical removals; see [Note: export format]
        rows = quant[f"{edit.module}.weight"][1] if f"{edit.module}.weight" in quant else None
        if rows is None:
            continue
        rows["codes"] = rows["codes"].index_select(edit.dim, edit.index)
        if edit.dim == 0:
            rows["scale"] = rows["scale"][edit.index]
            if rows["zero_point"] is not None:
                rows["zero_point"] = rows["zero_point"][edit.index]
    state = root.state_dict()
    quantized: dict[str, dict] = {}
    for key, (q, rows) in quant.items():
        weight = state[key]
        entry = {
            "scale": rows["scale"],
            "zero_point": rows["zero_point"],
            "bits": q.bits,
            "scheme": q.scheme,
            "shape": list(weight.shape),
            "dtype": str(weight.dtype).removeprefix("torch."),
            "offset": q.code_offset,
        }
        codes = rows["codes"]
        if not torch.equal(_row_dequantize(entry, codes), weight):
            raise AssertionError(f"export of {key} does not reproduce the cleaned weight")
        flat = QuantizedWeight(codes.reshape(1, -1), q.scale, None, q.bits, q.scheme, tuple(weight.shape), weight.dtype)
        entry["packed"] = pack_codes(flat)
        _compact_scales(entry)
        quantized[key] = entry
    ptrs = {(state[k].data_ptr(), tuple(state[k].shape)): k for k in quantized}
    tensors, aliases = {}, {}
    for key, value in state.items():
        if key in quantized:
            continue
        target = ptrs.get((value.data_ptr(), tuple(value.shape)))
        if target is not None:
            aliases[key] = target
        else:
            tensors[key] = value
    attributes = {
        n: {a: getattr(m, a) for a in (*HEAD_COUNT_ATTRS, "all_head_size") if isinstance(getattr(m, a, None), int)}
        for n, m in root.named_modules()
    }
    blob = {
        "format": _FORMAT,
        "tensors": tensors,
        "quantized": quantized,
        "aliases": aliases,
        "attributes": {n: a for n, a in attributes.items() if a},
    }
    path = Path(path)
    torch.save(blob, path)
    return ExportReport(path, path.stat().st_size, float_bytes, tuple(quantized))


_SIZE_ATTRS: dict[type[nn.Module], tuple[str, str | None]] = {
    nn.Linear: ("out_features", "in_features"),
    nn.Conv2d: ("out_channels", "in_channels"),
    nn.Embedding: ("num_embeddings", "embedding_dim"),
    nn.BatchNorm2d: ("num_features", None),
}


def _resize(root: nn.Module, key: str, shape: tuple[int, ...]) -> None:
    mod_name, _, pname = key.rpartition(".")
    module = root.get_submodule(mod_name)
    current = getattr(module, pname)
    if current is None or tuple(current.shape) == shape:
        return
    new = torch.zeros(shape, dtype=current.dtype, device=current.device)
    setattr(
        module,
        pname,
        nn.Parameter(new, requires_grad=current.requires_grad) if isinstance(current, nn.Parameter) else new,
    )
    for kind, (out_attr, in_attr) in _SIZE_ATTRS.items():
        if isinstance(module, kind) and pname == "weight":
            setattr(module, out_attr, shape[0])
            if in_attr is not None and len(shape) > 1:
                setattr(module, in_attr, shape[1])
        elif isinstance(module, kind) and pname != "weight" and in_attr is None:
            setattr(module, out_attr, shape[0])


def load_compressed(path: str | os.PathLike[str], model: nn.Module) -> nn.Module:
    """Loads a `save_compressed` file into ``model`` (built with the original architecture) and returns it.

    Layers that were shrunk by cleaning are resized, head-count attributes restored, and quantized weights
    dequantized (bit-identical to the exported model's weights).

    The file is read weights-only: nothing stored in it is called (the format is tensors and plain data).

    Raises:
        ValueError: If the file is not a zlightning compressed export.
        UnsafeCheckpointError: If the file names types that only full unpickling would rebuild (never true of a
            `save_compressed` file); nothing is loaded then.
    """
    blob = load_file(path, opt_in=None, map_location=None)
    if not isinstance(blob, dict) or blob.get("format") != _FORMAT:
        raise ValueError(f"{path} is not a zlightning compressed export (expected format {_FORMAT!r}).")
    root = _root(model)
    state: dict[str, Tensor] = dict(blob["tensors"])
    for key, entry in blob["quantized"].items():
        numel = int(torch.Size(entry["shape"]).numel())
        codes = unpack_codes(entry["packed"], entry["bits"], numel, entry["offset"])
        state[key] = _row_dequantize(_expand_scales(entry), codes)
    for key, target in blob["aliases"].items():
        state[key] = state[target]
    for key, value in state.items():
        _resize(root, key, tuple(value.shape))
    for name, attrs in blob["attributes"].items():
        module = root.get_submodule(name)
        for attr, value in attrs.items():
            setattr(module, attr, value)
    root.load_state_dict(state, strict=True)
    return model
