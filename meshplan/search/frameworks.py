"""One search across frameworks: ``meshplan search --framework deepspeed,megatron_deepspeed``.

A search plans every candidate under one runtime, the config's ``training.framework`` and
engines (:mod:`meshplan.search.driver`). "DeepSpeed ZeRO-3 or Megatron-DeepSpeed TP+PP for my
34B on 128 A100 40GB?" (newcomer trial 32 #5, issue 11 item 7) asks for the meshes of two
runtimes in one ranking. Each name of :data:`FRAMEWORKS` is the ``[training]`` keys that make
a config that runtime's, the same keys its own config imports to, and the ``[search]`` narrowing
to the meshes it runs:

- ``torch``: torchtitan (``framework = "torch"``, FSDP2/HSDP, DTensor TP/SP, CP, torch's
  pipelining), the engines at their defaults.
- ``megatron``: Megatron-LM (``framework = "megatron"``: its TP/SP, CP, PP with interleaved
  1F1B, the distributed optimizer or Megatron FSDP).
- ``deepspeed``: DeepSpeed's engine on the model's own code (``framework = "torch"``,
  ``zero12_engine`` and ``zero3_engine = "deepspeed"``), ZeRO over one data axis: the ``[search]``
  table a DeepSpeed JSON imports with (:data:`meshplan.interop.deepspeed.SEARCH`).
- ``megatron_deepspeed``: Megatron-DeepSpeed (``framework = "megatron"`` with DeepSpeed's
  engines, what ``--deepspeed --zero-stage N`` imports to, :mod:`meshplan.interop.megatron_deepspeed`):
  Megatron-LM's TP/SP and pipeline stages under DeepSpeed's ZeRO and PipelineEngine; the search's
  rule ``engine`` rejects what that engine refuses (ZeRO-2/3 or vpp > 1 beside pp > 1: its
  ``runtime/pipe/engine.py``); narrowed here to what its arguments have (microsoft/Megatron-DeepSpeed
  f4157be ``megatron/arguments.py``): no HSDP (``dp_replicate`` 1), no CP (no
  ``--context-parallel-size``; its ``--ds-sequence-parallel-size`` is DeepSpeed-Ulysses, an all-to-all
  meshplan does not model as cp: ``cp`` 1), no ``--tp-comm-overlap`` (``tp_comm_overlap`` false) and no
  ``--decoder-first/last-pipeline-num-layers`` (``uneven_stages`` false: with pp > 1 its GPTModelPipe
  partitions the transformer layers with DeepSpeed's ``partition_method="type:transformer"``,
  ``megatron/model/gpt_model.py:463``).

Every candidate of a framework is planned by that framework's search (:func:`cross_search` runs
:func:`~meshplan.search.driver.search` once per framework on :func:`framework_config`); the rows
of all of them are then ranked by one rule, the search's (:func:`~meshplan.search.rank.tie_order`
over step, :func:`~meshplan.search.tie_key.simplicity` and peak; under ``[search]
headroom_tier`` the rows under 15% of usable memory free after the others), each row naming its
framework. The same mesh under two frameworks is two rows: two runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional

from meshplan.config import Config
from meshplan.config_errors import build
from meshplan.errors import ConfigError
from meshplan.interop.deepspeed import DS_SCOPE, SEARCH as DEEPSPEED_SEARCH
from meshplan.memory.constraints import usable_bytes
from meshplan.memory.headroom import tight as tight_peak
from meshplan.search.exact import Exact
from meshplan.search.rank import decide, tie_order
from meshplan.search.tie_key import simplicity
from meshplan.spec.search import SearchOptions
from meshplan.spec.training import TrainingSpec
from meshplan.spec.training_checks import MEGATRON_ONLY, ZEROPP_KEYS

#: The ``[training]`` keys that name the runtime: each framework sets all of them.
ENGINE_KEYS = ("framework", "zero3_engine", "zero12_engine", "zero0_engine")
#: ``[training]`` keys whose unset value follows the framework (``vocab_pad_divisor``, ``param_dtype``,
#: ``grad_dtype``: :mod:`meshplan.spec.training_fields`): left to the new framework where the config's
#: value is its own framework's default (:func:`_given_keys`).
DERIVED = ("vocab_pad_divisor", "param_dtype", "grad_dtype")


#: ``[training]`` keys of one runtime's own knobs, dropped (with a note, :func:`dropped_keys`) where
#: the framework searched does not run that runtime: DeepSpeed's ``zero_optimization`` knobs
#: (``overlap_comm``, ``contiguous_gradients``), which only its engines take, and Megatron-LM's own
#: flags (:data:`meshplan.spec.training_checks.MEGATRON_ONLY`: its DDP, FSDP and p2p knobs), which
#: DeepSpeed's engine replaces under Megatron-DeepSpeed and torch has not.
DEEPSPEED_KEYS = ("overlap_comm", "contiguous_gradients")
#: Megatron-LM's own keys beside :data:`MEGATRON_ONLY`, which neither torch nor Megatron-DeepSpeed has:
#: ``--recompute-modules`` (:mod:`meshplan.spec.recompute_modules`) and the generation with its data
#: loader's mask (``megatron_runtime``, ``dataloader_attention_mask``: Megatron-DeepSpeed runs 2022's,
#: the unset default), dropped there like the :data:`MEGATRON_ONLY` keys.
RECOMPUTE_MODULES = ("recompute_modules", "megatron_runtime", "dataloader_attention_mask")
#: DeepSpeed's own keys that Megatron-DeepSpeed alone runs (DeepSpeed's ``PipelineEngine`` running
#: ``GPTModelPipe``: ``pp_engine``), dropped under every other framework.
MEGATRON_DEEPSPEED_KEYS = ("pp_engine",)


@dataclass(frozen=True)
class Framework:
    """One runtime a search can plan under: ``training``, the keys of :data:`ENGINE_KEYS`;
    ``search``, the ``[search]`` lists narrowed to what it runs; ``runs``, what it runs, one phrase."""

    training: dict[str, str]
    search: dict[str, list[Any]]
    runs: str


_TORCH = {"framework": "torch", "zero3_engine": "fsdp2", "zero12_engine": "megatron", "zero0_engine": "ddp"}
#: DeepSpeed's engine is named by the key of the config's sharding (a DeepSpeed JSON imports one, for
#: its stage: :data:`meshplan.interop.megatron_deepspeed.STAGES`); the search plans its other shardings
#: under the same runtime (``TrainingSpec.searched_zero3_engine``, ``searched_zero12_engine``).
_DS = {"zero3_engine": "deepspeed"}
FRAMEWORKS: dict[str, Framework] = {
    "torch": Framework(_TORCH, {}, "torchtitan: FSDP2 or HSDP, DTensor TP/SP, CP, torch's pipeline schedules"),
    "megatron": Framework(_TORCH | {"framework": "megatron"}, {},
                          "Megatron-LM: its TP/SP, CP, PP (interleaved 1F1B), distributed optimizer or Megatron FSDP"),
    "deepspeed": Framework({"framework": "torch"} | _DS, {k: list(v) for k, v in DEEPSPEED_SEARCH.items()},
                           f"DeepSpeed's ZeRO-1/2/3 on the model's code: {DS_SCOPE}"),
    "megatron_deepspeed": Framework({"framework": "megatron"} | _DS,
                                    {"dp_replicate": [1], "cp": [1], "sharding": ["zero1", "zero2", "zero3"],
                                     "tp_comm_overlap": [False], "uneven_stages": [False]},
                                    "Megatron-DeepSpeed: Megatron-LM's TP/SP and PP (DeepSpeed's PipelineEngine, "
                                    "1F1B, ZeRO-1 beside pp > 1) with DeepSpeed's ZeRO; no HSDP, CP or TP overlap"),
}


def configured_names(cfg: Config) -> tuple[str, ...]:
    """``[search] frameworks`` of ``cfg``, each once (``()`` unset: the config's own framework).

    >>> from typing import get_args
    >>> from meshplan.spec.search import SearchedFramework
    >>> tuple(FRAMEWORKS) == get_args(SearchedFramework)  # one list of names
    True
    """
    return tuple(dict.fromkeys(cfg.search.frameworks or ()))


def framework_names(text: str) -> tuple[str, ...]:
    """The names of ``--framework`` (comma-separated, each once, in the order given); a
    ConfigError naming ``--framework`` for an unknown one or none.

    >>> framework_names("deepspeed, megatron_deepspeed,deepspeed")
    ('deepspeed', 'megatron_deepspeed')
    >>> framework_names("fsdp")
    Traceback (most recent call last):
    meshplan.errors.ConfigError: --framework: 'fsdp'; use one or more of torch, megatron, deepspeed, megatron_deepspeed, comma-separated
    """
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    bad = next((n for n in names if n not in FRAMEWORKS), None) if names else text
    if bad is not None:
        raise ConfigError("--framework", f"{bad!r}; use one or more of {', '.join(FRAMEWORKS)}, comma-separated")
    return names


def dropped_keys(training: TrainingSpec, name: str) -> list[str]:
    """The ``[training]`` keys ``training`` gives that framework ``name`` does not run
    (:data:`DEEPSPEED_KEYS` and DeepSpeed ZeRO++'s :data:`~meshplan.spec.training_checks.ZEROPP_KEYS`
    outside DeepSpeed, :data:`~meshplan.spec.training_checks.MEGATRON_ONLY` and :data:`RECOMPUTE_MODULES`
    outside Megatron-LM, :data:`MEGATRON_DEEPSPEED_KEYS` outside Megatron-DeepSpeed), each left out of
    its search.

    >>> t = TrainingSpec(global_batch=8, seq_len=16, sharding="zero2", zero12_engine="deepspeed", overlap_comm=True)
    >>> dropped_keys(t, "torch"), dropped_keys(t, "megatron_deepspeed")
    (['overlap_comm'], [])
    >>> core = TrainingSpec(global_batch=8, seq_len=16, framework="megatron", megatron_runtime="core")
    >>> dropped_keys(core, "torch"), dropped_keys(core, "megatron_deepspeed"), dropped_keys(core, "megatron")
    (['megatron_runtime'], ['megatron_runtime'], [])
    """
    f = FRAMEWORKS[name].training
    deepspeed = f.get("zero3_engine") == "deepspeed"
    megatron = f["framework"] == "megatron" and not deepspeed
    mds = f["framework"] == "megatron" and deepspeed
    given = training.model_dump(exclude_unset=True)
    return [k for k in given if ((k in DEEPSPEED_KEYS or k in ZEROPP_KEYS) and not deepspeed) or (
        (k in MEGATRON_ONLY or k in RECOMPUTE_MODULES) and not megatron) or (k in MEGATRON_DEEPSPEED_KEYS and not mds)]


def _given_keys(training: TrainingSpec) -> dict[str, Any]:
    """The ``[training]`` keys the config gave, less :data:`ENGINE_KEYS` and the :data:`DERIVED` keys
    whose value is what its own framework fills in unset (so the new framework fills its own)."""
    given = {k: v for k, v in training.model_dump(exclude_unset=True).items() if k not in ENGINE_KEYS}
    for k in DERIVED:
        if k in given:
            rest = {x: v for x, v in training.model_dump(exclude_unset=True).items() if x != k}
            if getattr(TrainingSpec(**rest), k) == given[k]:
                del given[k]
    return given


def _ds_engine(sharding: str) -> dict[str, str]:
    """The keys that name DeepSpeed's engine for ``sharding`` (module docstring of
    :mod:`meshplan.interop.megatron_deepspeed`): zero1/zero2 ``zero12_engine``, none ``zero0_engine``,
    zero3 ``zero3_engine``; hsdp, which DeepSpeed does not run, as zero3 (its search lists no hsdp).

    >>> _ds_engine("zero2"), _ds_engine("hsdp")
    ({'zero3_engine': 'fsdp2', 'zero12_engine': 'deepspeed'}, {'zero3_engine': 'deepspeed', 'sharding': 'zero3'})
    """
    if sharding in ("zero1", "zero2"):
        return {"zero3_engine": "fsdp2", "zero12_engine": "deepspeed"}
    if sharding == "none":
        return {"zero3_engine": "fsdp2", "zero0_engine": "deepspeed"}
    return {"zero3_engine": "deepspeed", "sharding": "zero3"}


#: The note of a search by framework of a DeepSpeed JSON read directly (:func:`_user_search`).
ORIGIN_NOTE = ("the DeepSpeed config's [search] (ZeRO over one data axis, its import's note) is not applied under "
               "--framework: each framework searches what its runtime runs")


def _user_search(cfg: Config) -> SearchOptions:
    """``cfg``'s ``[search]`` as the user gave it: a DeepSpeed JSON read directly (``origin``
    ``deepspeed``) has none, its importer's narrowing to what DeepSpeed runs
    (:data:`meshplan.interop.deepspeed.SEARCH`) is left out, so that ``--framework`` names the runtimes."""
    if cfg.origin != "deepspeed":
        return cfg.search
    given = cfg.search.model_dump(exclude_unset=True)
    return SearchOptions(**{k: v for k, v in given.items() if k not in DEEPSPEED_SEARCH})


def framework_config(cfg: Config, name: str, keep_mesh: bool = True) -> Config:
    """``cfg`` under framework ``name`` (:data:`FRAMEWORKS`): its ``[training]`` keys set, its
    ``[search]`` lists narrowed to what the framework runs (a list the config narrowed is kept
    where the framework allows some of it; none allowed: a ConfigError naming the key); under
    ``megatron_deepspeed`` a ZeRO-0/1 config runs DeepSpeed's PipelineEngine (``pp_engine =
    "deepspeed"``, what its import sets without ``--no-pipeline-parallel``; its searched zero1 rows
    too, whatever the config's sharding: :attr:`~meshplan.spec.training.TrainingSpec.searched_pp_engine`); a key the
    framework refuses (a Megatron-LM flag under torch) is the training's one-line error, naming the
    framework. ``keep_mesh`` False: without the config's ``[mesh]`` (a cross-framework search ranks
    no mesh of one framework's)."""
    f = FRAMEWORKS[name]
    drop = dropped_keys(cfg.training, name)
    keys = {k: v for k, v in _given_keys(cfg.training).items() if k not in drop} | f.training
    if "zero3_engine" in f.training and f.training["zero3_engine"] == "deepspeed":
        keys |= _ds_engine(cfg.training.sharding)
        if f.training["framework"] == "megatron" and cfg.training.sharding in ("none", "zero1"):
            keys["pp_engine"] = "deepspeed"  # GPTModelPipe under the PipelineEngine, as its import sets it
    try:
        training = build(TrainingSpec, keys, "training")
    except ConfigError as e:
        raise ConfigError(e.field, f"{e.message} (under --framework {name}: {f.runs})") from None
    search = _user_search(cfg)
    update: dict[str, list[Any]] = {}
    for key, allowed in f.search.items():
        given = getattr(search, key)
        kept = allowed if given is None or key not in search.model_fields_set else [v for v in given if v in allowed]
        if not kept:
            raise ConfigError(f"search.{key}", f"{given} leaves --framework {name} nothing to search: it runs "
                              f"{key} {allowed} only ({f.runs}); widen the list or leave {name} out")
        update[key] = kept
    return replace(cfg, training=training, search=search.model_copy(update=update),
                   mesh=cfg.mesh if keep_mesh else None)


@dataclass(frozen=True)
class Row:
    """One row of the cross-framework ranking: ``framework``, the name; ``result``, that
    framework's :class:`~meshplan.search.driver.SearchResult`; ``exact``, its candidate."""

    framework: str
    result: Any
    exact: Exact

    @property
    def step(self) -> float:
        """The exact step, seconds (every row of a search's top has one)."""
        return float("inf") if self.exact.step_s is None else float(self.exact.step_s)

    @property
    def peak(self) -> float:
        """The planned peak, bytes (inf where not planned)."""
        return float("inf") if self.exact.peak_bytes is None else float(self.exact.peak_bytes)

    @property
    def key(self) -> tuple[int, ...]:
        """The tie rule's key of the row (:func:`~meshplan.search.tie_key.simplicity`)."""
        return simplicity(self.result.candidates, self.exact.index)

    def tight(self) -> bool:
        """Under 15% of usable memory free (:func:`meshplan.memory.headroom.tight`)."""
        cfg = self.result.config
        return tight_peak(self.exact.peak_bytes, usable_bytes(cfg.cluster, cfg.training),
                          cfg.memory.fragmentation_fraction)


@dataclass
class CrossResult:
    """Outcome of :func:`cross_search`: ``results``, each framework's search by name, in the order
    given; ``rows``, the ranking across them (at most ``[search] top``); ``decided_by``, the
    search's rule placing row 1 before row 2 (:func:`~meshplan.search.rank.decide`), "" with
    fewer than two rows; ``notes``, lines for under the table."""

    results: dict[str, Any]
    rows: list[Row]
    decided_by: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def wall_s(self) -> float:
        return sum(r.wall_s for r in self.results.values())


def rank_rows(rows: list[Row], top: int, tiers: bool) -> list[Row]:
    """``rows`` in the search's order (:func:`~meshplan.search.rank.tie_order` over step, key and
    peak), with ``tiers`` the tight rows after the others, cut to ``top``."""
    groups = [[r for r in rows if not r.tight()], [r for r in rows if r.tight()]] if tiers else [rows]
    out: list[Row] = []
    for g in groups:
        order = tie_order([r.step for r in g], [r.key for r in g], peaks=[r.peak for r in g])
        out += [g[j] for j in order]
    return out[:top]


def cross_search(cfg: Config, names: tuple[str, ...], search_one, progress=None) -> CrossResult:
    """Search ``cfg`` under each framework of ``names`` (:func:`framework_config`, without its
    ``[mesh]``) with ``search_one(config, progress)`` (:func:`~meshplan.search.driver.search`), and
    rank every framework's rows together (:func:`rank_rows`)."""
    results = {n: search_one(framework_config(cfg, n, keep_mesh=False), progress) for n in names}
    rows = [Row(n, r, e) for n, r in results.items() for e in r.top]
    ranked = rank_rows(rows, cfg.search.top, cfg.search.headroom_tier)
    notes = [] if cfg.mesh is None else ["the config's [mesh] is not ranked in a search of several frameworks "
                                         "(search one, --framework NAME, to rank it)"]
    notes += [line for n in names if (line := dropped_note(cfg, n))]
    notes += [ORIGIN_NOTE] if cfg.origin == "deepspeed" else []
    decided = ""
    if len(ranked) > 1:
        a, b = ranked[0], ranked[1]
        _, decided = decide([a.step, b.step], [a.key, b.key], [a.peak, b.peak])
        if a.tight() != b.tight():
            decided = "the headroom tiers: #2 keeps under 15% of usable memory free"
    return CrossResult(results, ranked, decided, notes)


def dropped_note(cfg: Config, name: str) -> str:
    """The note on the keys :func:`dropped_keys` leaves out of framework ``name``'s search; "" without any."""
    keys = dropped_keys(cfg.training, name)
    return (f"--framework {name} runs without training.{', training.'.join(keys)}: another runtime's knob"
            f"{'s' if len(keys) > 1 else ''}, left out of its search") if keys else ""


def framework_difference(a: Row, b: Row) -> Optional[str]:
    """``framework deepspeed vs megatron_deepspeed (DeepSpeed's ...; Megatron-DeepSpeed: ...)``
    where rows ``a`` (the top) and ``b`` (#2) run under different frameworks; None otherwise."""
    if a.framework == b.framework:
        return None
    return (f"framework {a.framework} vs {b.framework} ({FRAMEWORKS[a.framework].runs}; "
            f"{FRAMEWORKS[b.framework].runs})")
