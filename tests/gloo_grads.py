"""Gradients of a split model against the single-process model's on two gloo ranks, shared by
tests/test_validate_moe.py (tp 2 x ep 2) and tests/test_torch_etp_ep1.py (tp 2 = etp 2 at ep 1):
each rank writes every gradient's relative difference (:func:`grad_errors`, :func:`write_errors`);
the test forks the ranks and reads what each wrote (:func:`fork_ranks`)."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path


def join_gloo(rank: int, store_path: str, world: int = 2) -> None:
    """This process as rank ``rank`` of a gloo group of ``world`` (file rendezvous), one thread."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)


def split_model(spec, mesh, training, tp: int = 2):
    """The runtime model of ``spec`` as each rank builds it: made on the meta device, parallelized
    over ``mesh`` (no loss parallelism), materialized on CPU with seed-0 weights, the same as a
    single-process ``Transformer(spec)`` given ``init_weights(seed=0)``."""
    import torch

    from meshplan.runtime.execution.model import Transformer
    from meshplan.runtime.execution.parallelize import init_mesh, parallelize

    with torch.device("meta"):
        model = Transformer(spec, tp=tp)
    parallelize(model, init_mesh(mesh), mesh, training, loss_parallel=False)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    return model


def grad_errors(model, ref) -> dict[str, float]:
    """Each parameter of ``model`` -> max |g - g_ref| / max |g_ref|, its gradient against the same
    parameter's of the single-process ``ref``: a DTensor gradient gathered whole (the router's,
    Partial over tp, summed), routed experts held on this rank (EP: fewer rows than the module's
    ``full_rows``) against their rows ``offset`` on of the reference."""
    errors = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        want = ref.get_parameter(name).grad
        owner = model.get_submodule(name.rpartition(".")[0])
        if getattr(owner, "full_rows", want.shape[0]) != g.shape[0]:  # routed experts held here (EP)
            want = want[owner.offset:owner.offset + g.shape[0]]
        errors[name] = float((g - want).abs().max() / want.abs().max())
    return errors


def write_errors(out: str, rank: int, errors: dict) -> None:
    """Rank ``rank``'s ``errors`` as JSON at ``out.<rank>.json``, which :func:`fork_ranks` reads."""
    Path(out).with_suffix(f".{rank}.json").write_text(json.dumps(errors))


def fork_ranks(worker, tmp_path: Path, *args, world: int = 2, timeout_s: float = 150.0) -> list[dict]:
    """Run ``worker(rank, store_path, out, *args)`` on ``world`` forked processes (file rendezvous
    at ``tmp_path/store``), each exiting 0 within ``timeout_s``; what each wrote with
    :func:`write_errors` to ``out``, by rank."""
    ctx = multiprocessing.get_context("fork")
    store, out = str(tmp_path / "store"), str(tmp_path / "err")
    procs = [ctx.Process(target=worker, args=(r, store, out, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    assert [p.exitcode for p in procs] == [0] * world
    return [json.loads((tmp_path / f"err.{r}.json").read_text()) for r in range(world)]
