"""Mixed precision with torch.amp.GradScaler at two ranks, run by `make test` under `mpirun -np 2`
(and each test once under `horovodrun --gloo -np 2`), in the loop Horovod documents
(synchronize(), unscale_(), skip_synchronize()).

The loss scales here are powers of two, and multiplying by a power of two is exact in floating
point, so a run under a changing loss scale must reach the weights and the (unscaled)
compression state of a run without scaling bit for bit, if and only if the state is kept in
the units of the gradients it meets."""
from __future__ import annotations

import horovod.torch as hvd
import pytest
import torch

from helpers import same_bits, two_rank_marker
import hvd_compress.torch as hvdc

hvd.init()
WORLD, RANK = hvd.size(), hvd.rank()
pytestmark = two_rank_marker(WORLD)

# Every kind of state in gradient units: residuals (and the sign codecs' lazy carries), the
# owner residuals of the compressed allreduce, worker momentum, DGC's velocity and
# accumulator, PowerSGD's error (its Q is not in gradient units and stays as it is).
SPECS = ["onebit,ef=vanilla", "topk,k=0.05,ef=vanilla", "efsignsgd",
         "onebit,ef=vanilla,momentum=nesterov,mu=0.9", "dgc,k=0.05",
         "topk,k=0.05,ef=vanilla,collective=allreduce", "powersgd,rank=2,start_iter=1"]
BAD_STEP = 3  # rank 1's gradient overflows here (inf in one element, inside backward)


def model_and_data(steps, rank=RANK):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(100 + rank)
    xs = torch.randn(steps, 16, 16, generator=g)
    ys = torch.tanh(xs.sum(-1, keepdim=True) / 4) + 0.1 * torch.randn(steps, 16, 1, generator=g)
    return model, xs, ys


def run(spec, steps, scaler=None, pass_scaler=True, overflow=True, lr=0.1):
    """The documented AMP loop; without a scaler, the plain skip-on-non-finite loop. Returns
    (model, optimizer, skipped steps, loss scales seen)."""
    model, xs, ys = model_and_data(steps)
    opt = hvdc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                    named_parameters=model.named_parameters(), compression=spec,
                                    min_compress_bytes=0,
                                    grad_scaler=scaler if pass_scaler else None)
    skipped, scales = [], []

    def overflow_hook(g):
        g = g.clone()
        g.view(-1)[3] = float("inf")
        return g

    for i in range(steps):
        opt.zero_grad()
        hook = (model[0].weight.register_hook(overflow_hook)
                if overflow and i == BAD_STEP and RANK == 1 else None)
        loss = torch.nn.functional.mse_loss(model(xs[i]), ys[i])
        if scaler is None:
            loss.backward()
            opt.synchronize()
            if all(bool(torch.isfinite(q.grad).all()) for q in model.parameters()):
                with opt.skip_synchronize():
                    opt.step()
            else:
                skipped.append(i)
        else:
            scales.append(scaler.get_scale())
            scaler.scale(loss).backward()
            opt.synchronize()
            scaler.unscale_(opt)
            with opt.skip_synchronize():
                scaler.step(opt)
            scaler.update()
            if scaler.get_scale() < scales[-1]:
                skipped.append(i)
        if hook is not None:
            hook.remove()
    return model, opt, skipped, scales


def scaler(growth_interval=2):
    # growth every 2 good steps: the scale goes up and (at the overflow) down within a short run
    return torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=growth_interval)


def unscaled_state(opt):
    """The compression state divided by the loss scale it was kept at (exact: a power of 2).
    PowerSGD's Q is not rescaled when the scale changes (the next P is orthogonalised, whatever
    Q's scale), but each step computes it afresh from that step's gradient, so it is at the
    last scale too."""
    state = opt.compression_state_dict()
    return {name: {kind: arr / state["loss_scale"] for kind, arr in kinds.items()}
            for name, kinds in state["slots"].items()}


@pytest.mark.parametrize("spec", SPECS)
def test_loss_scaling_is_invisible_to_the_compression_state(spec):
    steps = 8
    model, opt, skipped, scales = run(spec, steps, scaler())
    assert skipped == [BAD_STEP]
    assert 2.0 ** 10 < max(scales) and scales[BAD_STEP + 1] == scales[BAD_STEP] / 2
    plain, plain_opt, plain_skipped, _ = run(spec, steps)
    assert plain_skipped == [BAD_STEP]
    for a, b in zip(model.parameters(), plain.parameters()):
        assert torch.equal(a, b)
    want = plain_opt.compression_state_dict()["slots"]
    got = unscaled_state(opt)
    assert got.keys() == want.keys()
    for name, kinds in want.items():
        assert got[name].keys() == kinds.keys()
        for kind, arr in kinds.items():
            assert same_bits(got[name][kind], arr), (name, kind)


def test_without_the_scaler_the_residuals_meet_gradients_in_other_units():
    """The same run, the optimizer not told of the scaler: the weights part from the unscaled
    run's (what grad_scaler= prevents)."""
    spec = "onebit,ef=vanilla"
    model, _, _, _ = run(spec, 8, scaler(), pass_scaler=False)
    plain, _, _, _ = run(spec, 8)
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))


@pytest.mark.parametrize("spec", ["onebit,ef=vanilla", "topk,k=0.05,ef=vanilla", "dgc,k=0.05",
                                  "powersgd,rank=2,start_iter=1"])
def test_an_overflow_costs_one_step_and_training_goes_on(spec):
    steps, grow = 120, 10  # the scale ends at 2^21 at most (float32 holds PowerSGD's P = M Q)
    lr = 0.01 if spec.startswith("dgc") else 0.1  # DGC's own momentum 0.9: 10x the step
    model, _, skipped, scales = run(spec, steps, scaler(grow), lr=lr)
    assert skipped == [BAD_STEP]
    assert scales[BAD_STEP + 1] == scales[BAD_STEP] / 2
    clean, _, clean_skipped, _ = run(spec, steps, scaler(grow), overflow=False, lr=lr)
    assert clean_skipped == []
    _, xs, ys = model_and_data(8, rank=99)  # held-out batches
    with torch.no_grad():
        loss = torch.nn.functional.mse_loss(model(xs.view(-1, 16)), ys.view(-1, 1)).item()
        ref = torch.nn.functional.mse_loss(clean(xs.view(-1, 16)), ys.view(-1, 1)).item()
    assert all(bool(torch.isfinite(q).all()) for q in model.parameters())
    assert abs(loss - ref) <= 0.02 * ref, (loss, ref)


def test_grad_scaler_must_be_a_scaler():
    model, _, _ = model_and_data(1)
    with pytest.raises(ValueError, match="grad_scaler must be a torch.amp.GradScaler"):
        hvdc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(),
                                  compression="onebit", grad_scaler=2.0 ** 16)
