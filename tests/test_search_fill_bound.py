"""The step bound's fill (:func:`meshplan.search.timing._fill`): micro-batch 0's forward through the
stages before stage k. Under torch's multi-stage schedules every stage's chunk 0 is UNSHARDed at
the step's start (:mod:`meshplan.schedule.window_unshard`), so a later stage's first gathers may hide
behind its wait for input: only stage 0's gathering extra is certain; under the single-stage 1F1B
(and any framework without torch's window) each first forward gathers after its input, every extra
counts."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from meshplan.config import config_from_dict
from meshplan.search.timing import _fill


def _cfg(framework: str):
    return config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
                             "training": {"global_batch": 8, "seq_len": 8192, "framework": framework}},
                            require_mesh=False)


class _C(SimpleNamespace):
    def __len__(self):
        return len(self.vpp)


def test_fill_by_hand():
    """Three stages, hop (chunk-0 forward + p2p) 1, 2, 3 s, gathering extra 10 s each.
    1F1B at vpp 1 (gathers in the pass): fill = 0, 1 + 10 = 11, 11 + 2 + 10 = 23.
    Interleaved 1F1B at vpp 2 (torch UNSHARDs chunk 0 ahead): stage 0 waits for its gathers whole
    (0, 11), stage 1's may hide behind its 11 s wait: 11 + 2 = 13.
    Megatron-LM (no window, gathers in the pass) at vpp 2: 0, 11, 23 as 1F1B's."""
    st = SimpleNamespace(k=np.zeros((2, 3)))
    c = _C(vpp=np.array([1, 2]), ps=np.array([0, 0]))
    hop, extra = np.array([[1.0, 2.0, 3.0]] * 2), np.full((2, 3), 10.0)
    np.testing.assert_allclose(_fill(_cfg("torch"), c, st, {}, hop, extra), [[0, 11, 23], [0, 11, 13]])
    np.testing.assert_allclose(_fill(_cfg("megatron"), c, st, {}, hop, extra), [[0, 11, 23], [0, 11, 23]])
