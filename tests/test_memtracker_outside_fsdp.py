"""Parameters that no FSDP2 unit manages are counted as parameters and their gradients as
gradients by validate's memory tracker (:func:`meshplan.runtime.execution.memtracker.outside_fsdp`).

The routed experts of an MoE layer at efsdp 1 (ep = the data axis: each ep rank holds its
``E / ep`` experts whole) are ``fully_shard``'s ``ignored_params``, as torchtitan leaves them.
torch 2.13's FSDPMemTracker labels only the units' own sharded parameters: before the fix the
``memory max: params`` row of ``meshplan validate tests/data/validate_mixtral_ep2_fsdp.toml
--worlds 2`` read 1,190,400 B measured against 23,210,496 B predicted (-95%), the experts' bytes
showing up as activations (+753%) and their gradients as temporaries, and the run PASSED.
"""

import pytest

torch = pytest.importorskip("torch")


def test_an_ignored_parameter_is_a_parameter_and_its_gradient_a_gradient():
    """One rank of a fake process group of 2: a Linear(4, 4) with bias sharded by FSDP2 (20
    fp32 values, 10 per rank: 40 B) and a bias-free Linear(4, 8) left out of FSDP
    (``ignored_params``, 32 fp32 values whole on every rank: 128 B), as the experts at efsdp 1.
    By hand: params = 40 + 128 = 168 B, grads (after backward, before the optimizer) the same
    168 B; before the fix params read 40 B, grads 40 B."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from meshplan.runtime.execution.memtracker import LabelledMemTracker, outside_fsdp, relabelled_kinds
    from meshplan.runtime.validation.dryrun import fake_process_group

    with fake_process_group(2):
        mesh = dist.device_mesh.init_device_mesh("cpu", (2,))
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 8, bias=False))
        fully_shard(model, mesh=mesh, ignored_params={model[1].weight})
        assert outside_fsdp(model) == [model[1].weight]
        model(torch.ones(1, 4)).sum().backward()  # FSDP2 makes its unsharded parameters lazily: a step first
        model.zero_grad(set_to_none=True)  # as the optimizer leaves them
        tracker = LabelledMemTracker(model)
        handles = tracker.label_grads(model)
        try:
            with tracker:
                model(torch.ones(1, 4)).sum().backward()
        finally:
            for h in handles:
                h.remove()
    kmax, _, _ = relabelled_kinds(tracker.log)
    assert kmax["params"] == 20 // 2 * 4 + 4 * 8 * 4 == 168
    assert kmax["grads"] == 168
