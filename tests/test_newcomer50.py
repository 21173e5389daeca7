"""Findings of newcomer trial 50 (a torchtitan MoE user: Qwen3-235B-A22B and DeepSeek-V3 on 64 x 8 H200);
each test failed before its fix. Inputs in ``tests/data/nc50/`` (the trial's own files, cut where said).

#1 (high): ``expert_parallel_comm_backend = "deepep"`` in a qwen3 job was planned as DeepEP, though torchtitan's
qwen3 parallelize (pytorch/torchtitan e347b1e ``torchtitan/models/qwen3/infra/parallelize.py``:108-118) calls
``apply_moe_ep_tp`` without ``use_deepep``: only deepseek_v3 (``models/deepseek_v3/infra/parallelize.py``:99-134)
and llama4 (``models/llama4/infra/parallelize.py``:113-148) read the key. A qwen3 job now plans the standard
all-to-all, with a note that the key is ignored for that family.
"""

from __future__ import annotations

from pathlib import Path

from meshplan.interop.common import ImportOptions
from meshplan.interop.foreign import load_any

DATA = Path(__file__).parent / "data" / "nc50"
H200_64 = ImportOptions(cluster="dgx-h200", nodes=64)


def test_deepep_ignored_for_qwen3(tmp_path):
    """#1: the trial's ``qwen3_deepep_tt.toml`` (qwen3 235B-A22B, ep 16, backend "deepep") plans the standard
    all-to-all (``moe_dispatcher`` "alltoall", torchtitan's "standard") and says the key is ignored; the same
    job with ``[model] name = "deepseek_v3"`` (flavor 16B: 64 experts, ep 16 divides them) is read as DeepEP,
    since deepseek_v3's parallelize passes ``use_deepep=True`` (e347b1e parallelize.py:113, 133)."""
    cfg = load_any(DATA / "qwen3_deepep_tt.toml", "torchtitan", H200_64)
    assert cfg.training.moe_dispatcher == "alltoall"
    said = [n for n in cfg.notes if "expert_parallel_comm_backend" in n and "ignored" in n]
    assert len(said) == 1 and "qwen3" in said[0] and "standard all-to-all" in said[0]
    text = (DATA / "qwen3_deepep_tt.toml").read_text()
    dsv3 = text.replace('name = "qwen3"', 'name = "deepseek_v3"').replace('flavor = "235B-A22B"', 'flavor = "16B"')
    (tmp_path / "dsv3.toml").write_text(dsv3.replace("hf_assets_path", "# hf_assets_path"))
    cfg = load_any(tmp_path / "dsv3.toml", "torchtitan", H200_64)
    assert cfg.training.moe_dispatcher == "deepep"
    assert not [n for n in cfg.notes if "ignored" in n and "expert_parallel_comm_backend" in n]
