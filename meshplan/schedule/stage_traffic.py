"""Which pipeline stage's traffic a per-rank figure shows: the one home for it.

Under a pipeline the stages' collective tables differ: a MoE model's dense first layers
(DeepSeek-V3's ``first_k_dense_replace`` 3) put no ep all-to-all on stage 0, whose ranks then
send a fraction of what an expert stage's ranks send. A per-rank traffic figure taken from stage 0
hides the expert traffic (newcomer trial: ``compare`` of
``examples/deepseek-v3_2048xh100_pp16-ep64-dp128.toml`` against the same at ep 32 printed 16.1 GB on the network for
both, stage 0's, while stage 1's ranks send 1,049.9 GB and 1,214.8 GB). So every per-rank
traffic figure (``compare``'s bytes per link class, ``step``'s second edge-load table) is the
**maximum over stages**, and names its stage:

- :func:`rank_link_bytes`: bytes one rank of a stage sends per step on each link class, from
  the stage's own collective table: each row's :attr:`~meshplan.comm.row.CollectiveRow.link_bytes`
  (size x busbw factor, split over NVLink and the network by the row's algorithm and path)
  x its calls per step;
- :func:`busiest_stage`: the stage whose rank sends the most on one link class, the lowest
  such stage on ties (stages within 1e-9 of each other: stage 0 where all are alike);
- :func:`traffic_stage`: the stage whose links are loaded most, the one ``step`` prints an
  edge-load table for beside stage 0's: the busiest on the network, or on NVLink where no
  stage's traffic leaves its node;
- :func:`stage_label` and :data:`WHICH`: how an output names it (``... A 1049.9 GB (stage 1),
  B 1214.8 GB (stage 1)`` under ``the stage whose ranks send the most``).
"""

from __future__ import annotations

#: The link classes a rank's bytes are split over (:attr:`~meshplan.comm.row.CollectiveRow.link_bytes`'s order).
LINKS = ("nvlink", "network")


def rank_link_bytes(plan, stage: int) -> dict[str, float]:
    """{link class: bytes one rank of ``stage`` sends per step} over the stage's collective rows
    that leave the GPU (``local`` rows send nothing); a class no row uses is absent.

    Per row: :attr:`~meshplan.comm.row.CollectiveRow.link_bytes` (bytes per call on NVLink and
    on the network, nccl-tests' busbw factor x S split by the algorithm) x ``per_step``.
    """
    out: dict[str, float] = {}
    for r in plan.stage(stage).collectives:
        for kind, b in zip(LINKS, r.link_bytes):
            if b and r.path.kind != "local":
                out[kind] = out.get(kind, 0.0) + b * r.per_step
    return out


def stage_link_bytes(plan) -> list[dict[str, float]]:
    """:func:`rank_link_bytes` of every stage, stage 0 first (one entry at pp 1)."""
    return [rank_link_bytes(plan, s) for s in range(plan.pp)]


def busiest_stage(per_stage: list[dict[str, float]], kind: str) -> int:
    """The stage whose rank sends the most bytes per step on link class ``kind``
    (``per_stage``: :func:`stage_link_bytes`), the lowest such stage: a stage counts as more
    only above the lowest maximum's bytes x (1 + 1e-9), so equal stages keep stage 0.

    >>> busiest_stage([{"network": 16.1e9}, {"network": 1214.8e9}, {"network": 1214.8e9}], "network")
    1
    >>> busiest_stage([{"nvlink": 5.0}, {"nvlink": 5.0 * (1 + 1e-12)}], "nvlink")
    0
    """
    best = 0
    for s, d in enumerate(per_stage):
        if d.get(kind, 0.0) > per_stage[best].get(kind, 0.0) * (1 + 1e-9):
            best = s
    return best


def traffic_kind(per_stage: list[dict[str, float]]) -> str:
    """The link class that decides :func:`traffic_stage`: ``network`` where any stage sends
    over it, else ``nvlink`` (one node, or a mesh whose every group stays inside a node)."""
    return "network" if any(d.get("network", 0.0) for d in per_stage) else "nvlink"


def traffic_stage(plan) -> int:
    """The stage whose links are loaded most (:func:`busiest_stage` on :func:`traffic_kind`'s
    link class); 0 at pp 1. DeepSeek-V3 at pp 16 x dp 128 x ep 64 on 256 dgx-h100: stage 1, the
    first expert stage (stages 1-14 are alike, 1,214.8 GB per rank per step on the network
    against the dense stage 0's 16.1 GB)."""
    per = stage_link_bytes(plan)
    return busiest_stage(per, traffic_kind(per))


def traffic_words(plan, stage: int) -> str:
    """Why ``stage`` (:func:`traffic_stage`) is shown, with its bytes against stage 0's:
    ``the stage whose ranks send the most, 1214.8 GB per rank per step over the network against
    stage 0's 16.1 GB`` (GB = 1e9 B)."""
    per = stage_link_bytes(plan)
    kind = traffic_kind(per)
    where = "over the network" if kind == "network" else "on NVLink"
    return (f"the stage whose ranks send the most, {per[stage].get(kind, 0.0) / 1e9:.1f} GB per rank per step "
            f"{where} against stage 0's {per[0].get(kind, 0.0) / 1e9:.1f} GB")


#: How a per-rank traffic figure names the rule that chose its stage (:func:`busiest_stage`).
WHICH = "the stage whose ranks send the most"


def stage_label(stage: int, pp: int) -> str:
    """``stage 1``: the stage of a per-rank figure (:func:`busiest_stage`), as outputs name it
    after the figure; empty at pp 1, where a rank's figure is the only one.

    >>> stage_label(1, 16), stage_label(0, 2), stage_label(0, 1)
    ('stage 1', 'stage 0', '')
    """
    return f"stage {stage}" if pp > 1 else ""
