"""Pipeline parallelism (``pp``): the layers split into stages, one per pp rank (with
``virtual_stages`` > 1, several chunks per rank; the schedule's own rules are its module's
under :mod:`meshplan.pipeline`).

Rule (search form; the exact plan checks the actual split, :func:`meshplan.mesh.layers.stage_layers`,
which also takes ``pp_layer_split`` and ``layers_per_virtual_stage``): at most one stage per
layer, and with vpp > 1 equal chunks (layers % pp == 0 and (layers / pp) % vpp == 0), but on
candidates with the Llama 3 split (column ``us``, :func:`meshplan.mesh.layers.ends_short_split`:
the search keeps those only where every stage fills its vpp chunks).

>>> from types import SimpleNamespace as N
>>> m = N(layers=32)
>>> [bool(PP.rules[0].bad(m, None, N(pp=p, vpp=v))) for p, v in ((4, 1), (64, 1), (4, 2), (4, 3))]
[False, True, False, True]
"""

from __future__ import annotations

from meshplan.spec.axes.base import AxisDef, CollectiveKind, Dim, Rule, SearchColumn


def _layers_bad(m, t, d):
    even = (m.layers % d.pp == 0) & ((m.layers // d.pp) % d.vpp == 0)
    return (d.pp > m.layers) | ((d.vpp > 1) & ~even & (getattr(d, "us", 0) == 0))


PP = AxisDef(
    doc="pipeline stages (layers)",
    torchtitan=("pp",), megatron=("pp",),
    rules=(Rule("layers", 50, "layers vs pp/vpp", _layers_bad,
                where="meshplan.mesh.layers.stage_layers (the exact split)"),),
    divides=(Dim.LAYERS,),
    shards=("parameters", "gradients", "optimizer state", "activations"),
    collectives=(CollectiveKind("send/recv", "pp", "forward", "b x s/cp (/tp under SP) x h activation"),
                 CollectiveKind("send/recv", "pp", "backward", "its gradient")),
    search=SearchColumn(column="pp", option="pp"),
    weights={"pp": 1.0},
)
