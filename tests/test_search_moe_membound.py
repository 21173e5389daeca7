"""The NCCL communicators the search's memory bounds count (:func:`meshplan.search.memory.comm_axes`)
against the plan's (one per axis with rows in the collective table) on the small MoE of
``test_search`` under ``framework = "megatron"`` (issue membound).

Megatron-LM gives the routed experts their own gradient buffer, reduced over the expert
data-parallel group, only where ep > 1 or etp != tp (``param.allreduce = not use_expert_pgs``:
NVIDIA/Megatron-LM d98e8a6 ``megatron/core/extensions/transformer_engine.py`` 110, 1235-1239;
``megatron/core/distributed/param_and_grad_buffer.py`` 896-899); otherwise they reduce with the
dense parameters over dp x cp and the expert group carries no collective, so no communicator
(torch creates NCCL communicators at a group's first collective; Megatron-LM's
``init_process_group`` passes no ``device_id``, ``megatron/training/initialize.py`` 342-359).
The search counted one on every zero1 row with efsdp > 1: 60 rows of ``world8-moe-megatron``
had a memory lower bound above the exact peak (``test_search``, now checked with no margin).
"""

from __future__ import annotations

import pytest

from meshplan.memory.timeline import _common
from meshplan.plan import build_plan
from meshplan.search.memory import comm_axes
from meshplan.search.space import candidate_config, enumerate_candidates
from test_search import CASES, config


@pytest.fixture(scope="module")
def megatron():
    kw = dict(CASES["8-moe"], training={"framework": "megatron"})
    cfg = config(kw.pop("nodes"), kw.pop("hbm_gb"), **kw)
    c = enumerate_candidates(cfg)
    return cfg, c, comm_axes(cfg, c), {c.label(i): i for i in range(len(c))}


@pytest.mark.parametrize("label,axes", [
    # ep 1, etp 1 = tp 1: the experts in the dense buffer over dp (was 2: an efsdp communicator)
    ("dp 8, mb 1, selective, vpp 1, zero1", ["dp"]),
    # ep 1, etp 2 = tp 2: the same, beside tp's and the etp group's (Megatron-LM's expert tensor-parallel
    # group, its own communicator, over which its dispatcher all-gathers the routed tokens and
    # reduce-scatters the experts' output: comm.ep_rows._etp_rows), and, dropless, the tp_ep group's
    # (_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP, the etp ranks at ep 1: its own communicator, over which
    # it all-gathers the per-expert counts, token_dispatcher.py:557-574; the table's "ep" row)
    ("dp 4 x tp 2 x etp 2, mb 1, selective, vpp 1, zero1", ["dp", "tp", "ep", "etp"]),
    # ep 1, etp 1 != tp 2: the experts' own buffer over efsdp 8 (dp 4 x tp 2)
    ("dp 4 x tp 2, mb 1, selective, vpp 1, zero1", ["dp", "tp", "efsdp"]),
    # ep 2: their own buffer over efsdp 4, and ep's all-to-alls
    ("dp 8; experts efsdp 4 x ep 2, mb 1, selective, vpp 1, zero1", ["dp", "efsdp", "ep"]),
    # Megatron FSDP (zero3) at ep 1, etp = tp: the experts gathered with their layer; etp's and tp_ep's groups as above
    ("dp_shard 4 x tp 2 x etp 2, mb 1, selective, vpp 1, zero3", ["dp_shard", "tp", "ep", "etp"]),
])
def test_communicators_are_the_plans(megatron, label, axes):
    cfg, c, n, at = megatron
    i = at[label]
    assert _common(build_plan(candidate_config(cfg, c, i)))[0] == axes
    assert int(n[i]) == len(axes)
