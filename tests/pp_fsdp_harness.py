"""Run one torch pipeline schedule over FSDP2 stages and report each stage's weight gradient against
a plain backward (tests/test_zbv_fsdp_torch.py, tests/test_zbh1_fsdp_torch.py): pp 2 as two gloo
processes, each stage one ``Linear`` + tanh, its layer a ``fully_shard`` unit inside a ``fully_shard``
stage module over a one-rank mesh of its own rank (FSDP2 swaps sharded and unsharded parameters as
over a larger data axis), 4 micro-batches of 4 rows. Stages: ``zb_h1`` (``ScheduleInterleavedZeroBubble``)
one per rank (stage r on rank r, 2 stages); ``zbv`` (``ScheduleZBVZeroBubble``) and ``dualpipev``
(``ScheduleDualPipeV``) a V of 4 (rank 0 holds stages 0 and 3, rank 1 stages 1 and 2)."""

from __future__ import annotations

import json
import subprocess
import sys


def case(schedule: str, reshard_after_forward: bool) -> dict[int, float | None]:
    """Stage -> max |grad - reference| of its layer's weight, None where torch left no gradient."""
    out = subprocess.run([sys.executable, __file__, schedule, str(int(reshard_after_forward))], capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    return {int(k): v for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def _layout(schedule: str, rank: int) -> tuple[int, list[int]]:
    """(stages in all, the stages rank ``rank`` holds) for ``schedule`` (module docstring)."""
    return (2, [rank]) if schedule == "zb_h1" else (4, sorted((rank, 3 - rank)))


def _rank(rank: int, schedule: str, rf: bool, init: str, queue) -> None:
    import copy

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    torch.manual_seed(0)

    class Part(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(8, 8)

        def forward(self, x):
            return torch.tanh(self.layer(x))

    n, mine = _layout(schedule, rank)
    parts = [Part() for _ in range(n)]
    ref = copy.deepcopy(parts)
    groups = [dist.new_group([0]), dist.new_group([1])]  # every rank creates both, in order
    mesh = DeviceMesh.from_group(groups[rank], "cpu")
    stages = []
    for s in mine:
        fully_shard(parts[s].layer, mesh=mesh, reshard_after_forward=rf)
        fully_shard(parts[s], mesh=mesh, reshard_after_forward=rf)
        stages.append(PipelineStage(parts[s], s, n, torch.device("cpu")))

    def loss_fn(out, y):
        return ((out - y) ** 2).mean()

    m = 4
    x, y = torch.randn(16, 8), torch.randn(16, 8)
    cls = {"zb_h1": schedules.ScheduleInterleavedZeroBubble, "zbv": schedules.ScheduleZBVZeroBubble,
           "dualpipev": schedules.ScheduleDualPipeV}[schedule]
    cls(stages, n_microbatches=m, loss_fn=loss_fn).step(*([x] if rank == 0 else []), target=y)
    for xm, ym in zip(x.chunk(m), y.chunk(m)):  # the schedule scales by 1 / m
        h = xm
        for r in ref:
            h = r(h)
        (loss_fn(h, ym) / m).backward()
    for s in mine:
        g = parts[s].layer.weight.grad
        queue.put((s, None if g is None else float((g.full_tensor() - ref[s].layer.weight.grad).abs().max())))
    dist.destroy_process_group()


def _main(schedule: str, rf: bool) -> None:
    import multiprocessing
    import tempfile

    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    init = tempfile.mktemp()
    procs = [ctx.Process(target=_rank, args=(r, schedule, rf, init, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=200) for _ in range(_layout(schedule, 0)[0]))
    for p in procs:
        p.join(60)
    print(json.dumps(got))


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2] == "1")
