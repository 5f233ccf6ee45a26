"""ZeRO-3 engine edge cases, each checked for parity with single-process training: tied weights, frozen parameters,
parameters unused in a step (no hang), a module called twice, a unit never called, buffers, no-grad evaluation,
and using the model after the engine hands it back."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests._zero_models import (
    batches,
    edge_net,
    gpt_loss,
    mse_loss,
    reference_train,
    regression_batches,
    tiny_gpt,
)
from zlightning.testing import run_distributed
from zlightning.zero import DeepSpeedZeroOptimizer_Stage3, ZeroConfig

CASES: dict[str, tuple[Any, Any, Any]] = {
    "gpt-tied": (tiny_gpt, gpt_loss, lambda n, b: batches(n, b)),
    "edge": (edge_net, mse_loss, regression_batches),
    "edge-frozen": (lambda: edge_net(freeze=True), mse_loss, regression_batches),
}


def _train(rank: int, world: int, case: str, cfg: ZeroConfig, steps: int) -> dict[str, Any]:
    factory, loss_fn, data_fn = CASES[case]
    model = factory()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.1)
    zero = DeepSpeedZeroOptimizer_Stage3(model, opt, config=cfg, gradient_clipping=1.0)
    eval_losses = []
    for batch in data_fn(steps, 4 * world):
        zero.backward(loss_fn(model, batch.chunk(world)[rank]))
        zero.step()
        with torch.no_grad():  # evaluation between steps, under no_grad and under inference_mode
            eval_losses.append(float(loss_fn(model, batch)))
        with torch.inference_mode():
            eval_losses.append(float(loss_fn(model, batch)))
    sd = zero.module_state_dict()
    plain = zero.unshard_module()
    with torch.no_grad():
        after = float(loss_fn(plain, data_fn(1, 4)[0]))
    plain_params = {n: p.detach().clone() for n, p in plain.named_parameters()}
    grads_none = [n for n, p in plain.named_parameters() if p.grad is not None]
    return {
        "sd": sd,
        "eval": eval_losses,
        "after": after,
        "plain": plain_params,
        "grads": grads_none,
        "hooks": sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in plain.modules()),
    }


@pytest.mark.parametrize("case", list(CASES))
def test_edge_case_parity(case: str) -> None:
    steps, world = 3, 2
    cfg = ZeroConfig(param_persistence_threshold=30)
    out = run_distributed(_train, world, case, cfg, steps, timeout=240)
    factory, loss_fn, data_fn = CASES[case]
    data = data_fn(steps, 4 * world)
    ref, _, _ = reference_train(factory(), data, accumulate=1, clip=1.0, loss_fn=loss_fn)
    # eval losses of the reference after each step
    ref_eval: list[float] = []
    model = factory()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.1)
    for batch in data:
        loss_fn(model, batch).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            ref_eval += [float(loss_fn(model, batch))] * 2
    for r in out:
        for name, value in ref.state_dict().items():
            if name == "calls":  # counts forward calls, including the extra evaluation passes
                continue
            torch.testing.assert_close(r["sd"][name], value, rtol=1e-5, atol=1e-6, msg=name)
            if name in r["plain"]:
                torch.testing.assert_close(r["plain"][name], value, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(r["eval"], ref_eval, rtol=1e-5, atol=1e-6)
        with torch.no_grad():
            torch.testing.assert_close(r["after"], float(loss_fn(ref, data_fn(1, 4)[0])), rtol=1e-5, atol=1e-6)
        assert r["hooks"] == 0, "unshard_module must leave no engine hooks behind"
        assert r["grads"] == []


def _tied_and_unused(rank: int, world: int) -> dict[str, Any]:
    gpt = tiny_gpt()
    zero = DeepSpeedZeroOptimizer_Stage3(gpt, torch.optim.SGD(gpt.parameters(), lr=0.1))
    zero.backward(gpt_loss(gpt, batches(1, 2)[0]))
    tied_piece = gpt.tok_emb._parameters["weight"] is gpt.head._parameters["weight"]
    zero.step()
    plain = zero.unshard_module()
    net = edge_net()
    zero2 = DeepSpeedZeroOptimizer_Stage3(net, torch.optim.SGD(net.parameters(), lr=0.1))
    zero2.backward(mse_loss(net, regression_batches(1, 4)[0]))
    unused = sorted(n for n, p in net.named_parameters() if p.grad is None)
    dist.barrier()
    return {
        "tied_piece": tied_piece,
        "tied_after": plain.tok_emb.weight is plain.head.weight,
        "unused": unused,
        "shape": tuple(plain.tok_emb.weight.shape),
    }


def test_tied_weights_stay_tied_and_unused_grads_stay_none() -> None:
    for r in run_distributed(_tied_and_unused, 2, timeout=120):
        assert r["tied_piece"] and r["tied_after"]
        assert r["shape"] == (64, 32)
        assert r["unused"] == [
            "blocks.1.unused.bias",
            "blocks.1.unused.weight",
            "blocks.3.fc.bias",
            "blocks.3.fc.weight",
            "blocks.3.norm.bias",
            "blocks.3.norm.weight",
        ]
