"""The recompute dimension of the search space (:mod:`meshplan.search.space`): which recompute
policies the search varies for a config (:func:`searched_recompute`) and on which rows each is a
candidate: torchtitan's op-level selective AC where its bound holds (:func:`op_recompute_ok`),
torchtitan's per-layer AC beside it at ep > 1 and with MLA (:func:`layer_for_op`, :func:`layer_rows`). Column functions over numpy arrays, one value per row.
"""

from __future__ import annotations

import numpy as np

from meshplan.config import Config


def op_recompute_ok(cfg: Config, tp: np.ndarray, cp: np.ndarray, ep: np.ndarray) -> np.ndarray:
    """Where ``recompute = "op"`` is searched: cp = 1, at any tp, any ep and with multi-head latent
    attention too. :func:`meshplan.plan.build_plan` refuses cp > 1 (which CP collectives its replay
    runs is not modelled). At tp > 1 (with sequence parallelism) the replay repeats the tp all-gathers
    and none of the blocks' closing collectives, whose outputs the policy saves
    (``layer_timeline.replay_scatters``), and the bound replays it so
    (:func:`meshplan.search.layer_chains.chains`); checked against every op row's simulated step and
    exact peak at tp 2, 4 and 8 (tests/test_search_op_sac.py; nc57 #7: torchtitan's default op SAC
    with TP had never been searched: 174 op rows at tp > 1 of a dense and an MoE 8-GPU search, no
    step or memory bound crossed). At ep > 1
    and with MLA the bound (:func:`meshplan.search.layer_chains.chains`) replays op without the EP
    all-to-alls and the closing TP collectives, whose outputs the policy saves, as the rank timeline
    does (``layer_timeline.forward_layer``); checked against every candidate's simulated step on an
    MoE and an MLA MoE search (tests/test_search_op_sac.py).

    >>> from meshplan.config import config_from_dict
    >>> cfg = config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
    ...                         "training": {"global_batch": 8, "seq_len": 1024}}, require_mesh=False)
    >>> op_recompute_ok(cfg, np.array([1, 2, 1]), np.array([1, 1, 2]), np.array([1, 1, 1])).tolist()
    [True, True, False]
    """
    return cp == 1


def searched_recompute(cfg: Config) -> list[str]:
    """The recompute policies the search varies: ``[search] recompute``, less ``op`` where the
    runtime has no op-level SAC (:attr:`~meshplan.spec.training.TrainingSpec.has_op_recompute`),
    and less ``selective`` where torchtitan is the runtime (the same condition) and the list is
    the default: ``selective`` is Megatron-LM's core-attention recompute, which torchtitan has no
    option for (:func:`meshplan.spec.recompute_words.recompute_words`), so a row with it could not be
    exported to torchtitan as planned; listed explicitly it is searched (what the user asked).
    ``layer`` (torchtitan's per-layer AC) only where torchtitan runs the rows, and only listed
    (it is not in the default list, :class:`~meshplan.spec.search.SearchOptions`). ``block``
    (Megatron-LM's block recompute) is not among them: the enumeration adds it where
    :func:`meshplan.search.block_recompute.block_searched`.

    >>> from meshplan.config import config_from_dict
    >>> d = {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
    ...      "training": {"global_batch": 8, "seq_len": 1024}}
    >>> searched_recompute(config_from_dict(d, require_mesh=False))
    ['none', 'full', 'op']
    >>> searched_recompute(config_from_dict(d | {"training": d["training"] | {"framework": "megatron"}},
    ...                                     require_mesh=False))
    ['none', 'selective', 'full']
    """
    t, listed = cfg.training, "recompute" in cfg.search.model_fields_set
    torchtitan = t.has_op_recompute
    return [r for r in cfg.search.recompute if r != "block"  # block_recompute.block_searched adds it
            if (r not in ("op", "layer") or torchtitan) and (r != "selective" or not torchtitan or listed)]


def layer_for_op(cfg: Config) -> bool:
    """Whether the search adds torchtitan's per-layer AC (``layer`` at
    :data:`~meshplan.search.columns.LAYER_AC_FREQ`) on the rows where the planner refuses ``op``
    for the model's experts or attention (:func:`layer_rows`): ``op`` is searched
    (:func:`searched_recompute`: torchtitan runs the rows) and ``layer`` is not listed (listed, it is
    searched on every row). Without it such rows tried none or full only, and a torchtitan user's
    first try, ``selective_ac_option = "2"``, was missed (newcomer: Mixtral-8x22B at dp_shard 256 x
    ep 8 on 32 x 8 H200, 16,366.62 ms at ac_freq 2 against full recompute's ~4.3 s more).

    >>> from meshplan.config import config_from_dict
    >>> d = {"model": {"catalog": "mixtral-8x7b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
    ...      "training": {"global_batch": 8, "seq_len": 1024}}
    >>> layer_for_op(config_from_dict(d, require_mesh=False))
    True
    >>> layer_for_op(config_from_dict(d | {"search": {"recompute": ["none", "full", "op", "layer"]}}, require_mesh=False))
    False
    """
    names = searched_recompute(cfg)
    return "op" in names and "layer" not in names


def layer_rows(cfg: Config, ep: np.ndarray) -> np.ndarray:
    """The rows :func:`layer_for_op` adds ``layer`` on: ep > 1, or a model with multi-head latent
    attention, where a torchtitan user's first try, ``selective_ac_option = "2"``, is searched beside
    ``op`` (before nc48fix the planner refused ``op`` there: which EP collectives its replay runs,
    which MLA mms it saves; :func:`op_recompute_ok`). Not at tp or cp > 1 with ep 1: those rows are
    the dense models' too, where ``layer`` stays opt-in (listed, the dense 405B benchmark plans 90
    candidates exactly against 70: ``[search] recompute``'s docstring).

    >>> from meshplan.config import config_from_dict
    >>> cfg = config_from_dict({"model": {"catalog": "mixtral-8x7b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
    ...                         "training": {"global_batch": 8, "seq_len": 1024}}, require_mesh=False)
    >>> layer_rows(cfg, np.array([1, 2, 8])).tolist()
    [False, True, True]
    """
    return (ep > 1) | bool(cfg.model.is_mla)
