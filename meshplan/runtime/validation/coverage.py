"""What a scaled-down ``meshplan validate`` world did not run: each axis of the config's mesh whose
degree is > 1 at full scale but 1 at the validated world size (newcomer trial: ``validate
chosen.toml --worlds 4`` scaled dp_shard 128 x tp 4 to dp_shard 1 and PASSED without saying that
FSDP never ran), and the smallest world the user could pass that runs it.

Only the data axis that absorbs the world size (:func:`~meshplan.runtime.validation.scaling.scale_mesh`)
changes degree, and with it efsdp (the experts' FSDP over the dense block left by ep x etp); every
other axis keeps the config's degree. A line per axis, as the summary, the console and ``--json``
print it::

    not exercised: dp_shard (FSDP) 128 -> 1; its collectives were not run; --worlds 8 runs dp_shard 2
"""

from __future__ import annotations

from typing import Optional

from meshplan.config import Config
from meshplan.errors import ConfigError
from meshplan.mesh.resolve import Infeasible, Mesh, resolve_mesh
from meshplan.runtime.validation.options import Options
from meshplan.runtime.validation.scaling import config_mesh, scale_mesh

#: How many larger data degrees :func:`runs_it` tries (2, 3, ...) before it names none.
TRIES = 64


def role(axis: str, sharding: str) -> str:
    """What the axis runs, in the field's terms (``dp`` after ``training.sharding``).

    >>> role("dp_shard", "zero3"), role("dp", "none"), role("dp", "zero1"), role("efsdp", "zero3")
    ('FSDP', 'DDP', 'ZeRO-1', "the experts' FSDP")
    """
    if axis == "dp":
        return {"none": "DDP", "zero3": "FSDP"}.get(sharding, sharding.replace("zero", "ZeRO-"))
    return {"dp_shard": "FSDP", "dp_replicate": "HSDP replicas", "efsdp": "the experts' FSDP"}.get(axis, axis)


def _scaled(spec, base: int, world: int, option: str) -> Optional[Mesh]:
    """The mesh validate runs at ``world``, or None where ``world`` does not scale."""
    try:
        small, _ = scale_mesh(spec, base, world, option)
    except ConfigError:
        return None
    mesh = resolve_mesh(small, world)
    return None if isinstance(mesh, Infeasible) else mesh


def runs_it(spec, base: int, world: int, axis: str, option: str) -> Optional[tuple[int, int]]:
    """The smallest world above ``world`` that validate scales with ``axis`` of degree >= 2, and
    that degree: worlds ``world / d0 x d`` for the data axis's degrees d = d0 + 1, d0 + 2, ...
    (:data:`TRIES` of them, up to the config's world; d0 its degree at ``world``), the first that
    scales (its ep x etp held) with ``axis`` >= 2.

    dp_shard 128 x tp 4 of 512 GPUs at world 4 (dp_shard 1): world 8 runs dp_shard 2.

    >>> from meshplan.spec.mesh import MeshSpec
    >>> runs_it(MeshSpec(names=["dp_shard", "tp"], shape=[128, 4]), 512, 4, "dp_shard", "--worlds")
    (8, 2)
    """
    here, full = _scaled(spec, base, world, option), resolve_mesh(spec, base)
    if here is None or isinstance(full, Infeasible):
        return None
    now = here.degree(_data_axis(full))
    for d in range(now + 1, now + 1 + TRIES):
        w = world // now * d
        if w > base:
            return None
        mesh = _scaled(spec, base, w, option)
        if mesh is not None and mesh.degree(axis) >= 2:
            return w, mesh.degree(axis)
    return None


def _data_axis(mesh: Mesh) -> str:
    """The data axis scale_mesh re-sizes in the config's (full-scale) ``mesh``: the outermost of
    degree > 1, else the outermost."""
    data = [a for a in mesh.layout.names if a in ("dp_replicate", "dp", "dp_shard")]
    return next((a for a in data if mesh.degree(a) > 1), data[0] if data else "dp")


def not_exercised(config: Config, world: int, opt: Options) -> list[dict]:
    """Each axis of ``config``'s mesh of degree > 1 at full scale and 1 at ``world``:
    ``{"axis", "role", "config_degree", "world", "runs_it": {"world", "degree"} or None, "line"}``
    (module docstring); ``opt.world_option`` names the option in the line. Empty where every axis
    of degree > 1 runs with degree > 1."""
    spec = config_mesh(config)
    base = spec.world or config.cluster.world
    full, small = resolve_mesh(spec, base), _scaled(spec, base, world, opt.world_option)
    if isinstance(full, Infeasible) or small is None:
        return []
    out = []
    for axis in [*full.layout.names, *(["efsdp"] if full.ep * full.etp > 1 else [])]:
        if full.degree(axis) <= 1 or small.degree(axis) != 1:
            continue
        what = role(axis, config.training.sharding)
        ran = ("its collectives were not run" if axis != "dp_shard" or small.degree("cp") == 1 else
               f"{what}'s collectives ran over cp {small.degree('cp')} alone (fsdp = dp_shard x cp)")
        hit = runs_it(spec, base, world, axis, opt.world_option)
        line = (f"not exercised: {axis} ({what}) {full.degree(axis)} -> 1; {ran}"
                + (f"; {opt.world_option} {hit[0]} runs {axis} {hit[1]}" if hit else ""))
        out.append({"axis": axis, "role": what, "config_degree": full.degree(axis), "world": world,
                    "runs_it": {"world": hit[0], "degree": hit[1]} if hit else None, "line": line})
    return out


def everywhere(results: list[dict]) -> list[dict]:
    """The entries of axes that no world of ``results`` exercised (in each world's
    ``not_exercised``), as the largest world gives them; empty when one world ran every axis."""
    if not results:
        return []
    common = set.intersection(*({e["axis"] for e in r.get("not_exercised", [])} for r in results))
    last = max(results, key=lambda r: r["world"])
    return [e for e in last.get("not_exercised", []) if e["axis"] in common]
