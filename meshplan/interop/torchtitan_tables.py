"""torchtitan's pipeline split, [activation_checkpoint], norm and optimizer tables, read and
written, and its [compile] table read (:func:`read_compile`); :mod:`meshplan.interop.torchtitan`
maps the rest of the job TOML and names the sources, the float8 tables:
:mod:`meshplan.interop.torchtitan_float8`.

The norm of torchtitan before 2025 (``model.norm_type``, removed by torchtitan #1131): at
9dec370 ``torchtitan/models/norms.py`` builds "rmsnorm" (the default) as its own Python
``RMSNorm`` (``training.torch_norm = "decomposed"``) and "fused_rmsnorm" as a Triton kernel
(``"fused"``, one kernel each way, as today's ``nn.RMSNorm``).
"""

from __future__ import annotations

from typing import Any

from meshplan.errors import ConfigError, did_you_mean, printable

#: torchtitan schedule name -> meshplan schedule; torch.distributed.pipelining names
#: (InterleavedZeroBubble: zb_h1, at one stage per rank only, ``spec.mesh.multi_stage_refusal``).
SCHEDULES = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved1f1b": "interleaved_1f1b", "zbvzerobubble": "zbv",
             "dualpipev": "dualpipev", "interleavedzerobubble": "zb_h1"}
#: torchtitan's multi-stage schedules: 2 stages per rank by default (``_get_pipeline_metadata``).
MULTI_STAGE = ("interleaved_1f1b", "zb_h1", "zbv", "dualpipev")
SCHEDULE_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B", "zbv": "ZBVZeroBubble",
                  "dualpipev": "DualPipeV"}
#: What export writes: zb_h1 too, as InterleavedZeroBubble with the pp parts of
#: module_fqns_per_model_part it always writes (torchtitan checks stages per rank only where it
#: generates the split, ``_get_pipeline_metadata``); not in SCHEDULE_NAMES, whose fix words lack the parts.
WRITTEN_SCHEDULES = SCHEDULE_NAMES | {"zb_h1": "InterleavedZeroBubble"}
#: Schedules with two stages per rank in a V (torch.distributed.pipelining ScheduleZBVZeroBubble,
#: ScheduleDualPipeV): torchtitan builds 2 x pp model parts for them.
V_SCHEDULES = ("zbv", "dualpipev")


def default_split(stages: int, layers: int, first_less: int = 1, last_less: int = 1) -> list[int]:
    """Layers per (virtual) stage as torchtitan cuts them without an explicit
    ``module_fqns_per_model_part``: the embedding counts as ``first_less`` layers and the
    norm + output as ``last_less``, ``layers + first_less + last_less`` spread evenly with
    the remainder on the first stages (pipeline_parallel.generate_llm_fqn_per_model_part).

    >>> default_split(16, 126)
    [7, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 7]
    >>> default_split(4, 32)
    [8, 9, 8, 7]
    """
    if stages == 1:
        return [layers]
    effective = layers + first_less + last_less
    base, extra = divmod(effective, stages)
    if base == 0 or first_less > base or last_less > base:
        raise ConfigError("parallelism.pipeline_parallel_degree",
                          f"{stages} stages cannot hold {layers} layers with first/last stage less "
                          f"{first_less}/{last_less} ({effective} effective layers)")
    want = [base + (k < extra) - (first_less if k == 0 else last_less if k == stages - 1 else 0)
            for k in range(stages)]
    out, left = [], layers
    for w in want:
        out.append(min(w, left))
        left -= out[-1]
    return out


def model_parts(split: list[int]) -> list[list[str]]:
    """torchtitan's ``module_fqns_per_model_part`` of layers per virtual stage: the
    embedding on the first part, the norm and output on the last.

    >>> model_parts([1, 2])
    [['tok_embeddings', 'layers.0'], ['layers.1', 'layers.2', 'norm', 'output']]
    """
    starts = [sum(split[:i]) for i in range(len(split))]
    parts = [[f"layers.{j}" for j in range(s, s + n)] for s, n in zip(starts, split)]
    parts[0].insert(0, "tok_embeddings")
    parts[-1] += ["norm", "output"]
    return parts


#: torchtitan's [activation_checkpoint] modes meshplan plans (torchtitan's job_config.py
#: ``ActivationCheckpoint.mode``; its ``memory_budget`` is not planned).
AC_MODES = ("none", "selective", "full")


def read_recompute(d: dict, deg: dict[str, int], mla: bool, notes: list[str]) -> dict[str, Any]:
    """training.recompute (and ac_freq) of torchtitan's [activation_checkpoint]: mode none and
    full as they are; selective with selective_ac_option "op" is op-level SAC (``op``), with
    an integer k every k-th layer in full (``layer``, ``ac_freq`` k; torchtitan's default
    option "2"). ``op`` is planned with cp = 1 only (build_plan says why; with tp > 1 as
    torchtitan applies TP, with sequence parallelism; MLA and MoE layers at any ep as
    :func:`meshplan.compute.recompute.op_sac_mms` says), so a mesh outside that (:func:`op_limits`
    of ``deg``, the cp degree) is planned with Megatron-LM's selective recompute, with a note;
    ``mla`` is not read (kept for the callers). A job TOML is torchtitan <= v0.2.2 (e347b1e), whose
    ``_apply_op_sac`` and save lists are 238fa99's: the import sets ``op_sac_policy = "238fa99"``
    (:func:`meshplan.compute.recompute.op_sac_fuses_qkv`; a Python config registry in b5bcd76's
    names ``"b5bcd76"``: :mod:`meshplan.interop.torchtitan_pyjob`)."""
    ac = d.get("activation_checkpoint", {})
    mode = ac.get("mode", "selective")
    if mode not in AC_MODES:  # a near miss first (selectiv), as the catalog names and mesh axes
        raise ConfigError("activation_checkpoint.mode", f"{str(mode)[:40]!r}: {did_you_mean(mode, AC_MODES)}"
                          f"{'' if did_you_mean(mode, AC_MODES) else 'not planned by meshplan; '}use none, "
                          f"selective or full")
    if mode != "selective":
        return {"recompute": mode}
    opt = str(ac.get("selective_ac_option", "2"))
    if opt == "op":
        why = op_limits(deg)
        if not why:
            return {"recompute": "op"}
        notes.append(f"activation_checkpoint selective_ac_option \"op\" (op-level SAC) is modelled with cp = "
                     f"1 only; with {', '.join(why)} planned as Megatron-LM's selective recompute "
                     f"(attention core recomputed, the other activations kept): more activation memory, less "
                     f"recompute time than op-level SAC")
        return {"recompute": "selective"}
    if not opt.isdigit() or int(opt) < 1:
        raise ConfigError("activation_checkpoint.selective_ac_option", f"{opt[:40]!r}; {did_you_mean(opt, ['op'])}"
                          f"use \"op\" or a whole number k >= 1 (every k-th layer checkpointed in full)")
    return {"recompute": "layer", "ac_freq": int(opt)}


def op_limits(deg: dict[str, int]) -> list[str]:
    """What keeps op-level SAC (``recompute = "op"``) from being planned at a mesh of cp degree
    ``deg["cp"]`` (:func:`meshplan.plan_checks` plans it with cp = 1 only; ep and MLA are planned).

    >>> op_limits({"cp": 4, "ep": 1}), op_limits({"cp": 1, "ep": 8})
    (['cp 4'], [])
    """
    return [f"cp {deg['cp']}"] if deg.get("cp", 1) > 1 else []


def write_recompute(t) -> dict[str, str]:
    """[activation_checkpoint] of ``t``: none and full as they are; op and layer as torchtitan's
    selective options "op" and "<ac_freq>". Megatron-LM's selective (attention core
    recomputed), which torchtitan has no option for, as what keeps what the plan kept: with
    flash attention ``none`` (the same activations but the flash softmax statistics,
    :func:`meshplan.memory.activations.layer_terms`), without it ``full`` (the softmax output
    is not kept); not op-level SAC, which saves and recomputes other tensors (the export's
    header says so, the re-import lists the difference)."""
    if t.recompute == "selective":
        return {"mode": "none" if t.flash_attention else "full"}
    if t.recompute in ("none", "full"):
        return {"mode": t.recompute}
    return {"mode": "selective", "selective_ac_option": str(t.ac_freq) if t.recompute == "layer" else "op"}


#: torchtitan's pre-2025 ``model.norm_type`` -> ``training.torch_norm`` (9dec370 ``build_norm``).
NORM_TYPES = {"rmsnorm": "decomposed", "fused_rmsnorm": "fused"}


def read_norm(d: dict, notes: list[str]) -> dict[str, Any]:
    """``training.torch_norm`` of torchtitan's pre-2025 ``model.norm_type`` (module docstring);
    nothing without the key (today's torchtitan: ``nn.RMSNorm``, the default "fused"). The
    LayerNorm choices are planned as the catalog model's norm, fused, with a note."""
    kind = d.get("model", {}).get("norm_type")
    if kind is None:
        return {}
    if kind in ("layernorm", "np_layernorm"):
        notes.append(f"model.norm_type {kind!r}: nn.LayerNorm, one fused kernel each way; planned with the model's "
                     f"own norm, fused")
        return {}
    if kind not in NORM_TYPES:
        raise ConfigError("model.norm_type", f"{kind!r}; torchtitan's choices were layernorm, np_layernorm, rmsnorm, "
                          f"fused_rmsnorm")
    return {"torch_norm": NORM_TYPES[kind]}


#: torchtitan's ``[optimizer] name`` -> meshplan ``training.optimizer`` (9dec370 ``optimizer.py``
#: builds ``torch.optim.Adam`` or ``AdamW``; AdamW is the default and every llama3 preset's).
OPTIMIZERS = {"AdamW": "adamw", "Adam": "adam"}
#: The two keys of the optimizer's implementation: ``implementation`` (820504e on, default
#: "fused") and the older ``fused`` flag (9dec370: ``store_true``, default false, ``foreach = not
#: fused``); :attr:`~meshplan.spec.training.TrainingSpec.optimizer_impl`.
IMPLEMENTATIONS = ("fused", "foreach")


def read_optimizer(d: dict, notes: list[str]) -> dict[str, Any]:
    """``training.optimizer`` and ``training.optimizer_impl`` of torchtitan's [optimizer]: ``name``
    (default AdamW), ``implementation`` or the older ``fused``; neither: today's torchtitan
    default, fused (a job of torchtitan before 2025 without ``fused = true`` ran foreach: write
    ``fused = false`` to plan it)."""
    o = d.get("optimizer", {})
    name = o.get("name", "AdamW")
    out: dict[str, Any] = {"optimizer": OPTIMIZERS.get(name, "adamw")}
    if name not in OPTIMIZERS:
        notes.append(f"optimizer.name {name!r}: meshplan models Adam and AdamW; planned as AdamW (two fp32 states)")
    if "implementation" in o and "fused" in o:
        raise ConfigError("optimizer.fused", "torchtitan before 2025 read it, later ones read "
                          "optimizer.implementation: give one of the two")
    if "fused" in o:
        if not isinstance(o["fused"], bool):
            raise ConfigError("optimizer.fused", f"{o['fused']!r}; use true (fused) or false (foreach)")
        return out | {"optimizer_impl": "fused" if o["fused"] else "foreach"}
    impl = o.get("implementation", "fused")
    if impl not in IMPLEMENTATIONS:
        raise ConfigError("optimizer.implementation", f"{impl!r} is not modelled (meshplan plans torch's fused and "
                          f"foreach Adam steps); use \"fused\" or \"foreach\"")
    return out | {"optimizer_impl": impl}


def write_optimizer(t) -> dict[str, Any]:
    """torchtitan's [optimizer] keys of ``t`` (a TrainingSpec): ``implementation`` (today's key),
    and ``name`` for Adam or AdamW."""
    names = {v: k for k, v in OPTIMIZERS.items()}
    return {"implementation": t.optimizer_impl} | ({"name": names[t.optimizer]} if t.optimizer in names else {})


def read_compile(c: dict, notes: list[str]) -> dict[str, bool]:
    """training.torch_compile and torch_compile_loss of torchtitan's [compile]: ``enable``
    (default false) with ``components`` (default model and loss): ["model"] compiles the
    TransformerBlocks and leaves the loss eager (as 9dec370 always did); the loss alone compiled
    is not modelled: planned eager, with a note."""
    enable = c.get("enable", False)
    if not isinstance(enable, bool):
        raise ConfigError("compile.enable", f"{enable!r}; use true or false")
    parts = c.get("components", ["model", "loss"])
    if not isinstance(parts, list) or not all(isinstance(x, str) for x in parts):
        raise ConfigError("compile.components", f"{parts!r}; use a list such as [\"model\", \"loss\"]")
    if enable and "model" not in parts:
        notes.append(f"compile.components {parts}: meshplan does not plan the loss compiled without the model; "
                     f"planned eager")
        return {"torch_compile": False}
    return {"torch_compile": enable} | ({"torch_compile_loss": False} if enable and "loss" not in parts else {})


def read_cp_attention(par: dict, cp: int, notes: list[str]) -> dict[str, str]:
    """torchtitan runs torch's ring attention at cp > 1, what ``cp_attention`` unset plans under
    framework torch (:attr:`~meshplan.spec.training.TrainingSpec.cp_ring`; written out, the key
    would be refused once the user switches the framework to megatron). Its
    ``context_parallel_rotate_method`` (v0.2.2 ``config/job_config.py``:446, "allgather" or
    "alltoall", torch's ``set_rotate_method``) is read: "alltoall" at cp > 1 sets
    ``training.cp_rotate`` (:func:`meshplan.spec.axes.cp.alltoall_kv_rows`), another value is an
    error; written, the key adds a note saying what was planned (nothing at cp 1, where no ring
    runs) and is carried unchanged on export (:data:`~meshplan.interop.torchtitan_carry.KEPT`).

    >>> notes = []
    >>> read_cp_attention({"context_parallel_rotate_method": "alltoall"}, 16, notes), notes[0][-49:]
    ({'cp_rotate': 'alltoall'}, 'the K/V shifted to the next rank beside each step')
    """
    rotate = par.get("context_parallel_rotate_method", "allgather")
    if rotate not in ("allgather", "alltoall"):
        raise ConfigError("parallelism.context_parallel_rotate_method", f"{printable(str(rotate))[:40]!r} is not "
                          "\"allgather\" or \"alltoall\" (torch's set_rotate_method); give one of the two")
    if "context_parallel_rotate_method" in par:
        notes.append(f"parallelism.context_parallel_rotate_method {rotate!r} read: " + (
            ("planned as torch's ring attention with the K/V all-gather rotation at cp " + str(cp)
             if rotate == "allgather" else f"planned as torch's ring attention at cp {cp} with the all-to-all "
             "rotation (training.cp_rotate): the K/V shifted to the next rank beside each step") if cp > 1 else
            "no effect at context_parallel_degree 1 (no ring attention runs)"))
    return {"cp_rotate": rotate} if cp > 1 and rotate == "alltoall" else {}


#: torchtitan revisions (``training.op_sac_policy``'s, :data:`~meshplan.spec.training_fields.OpSacPolicy`)
#: whose llama3 repeats K and V to the q heads before SDPA (``repeat_kv``, which ff0829c, in v0.2.2,
#: replaced by ``enable_gqa=True``: e347b1e ``models/llama3/model/model.py``:201, 275, 295): none, the
#: import's 238fa99 (the parent of 9810191, after e347b1e) and b5bcd76 both come after ff0829c.
REPEAT_KV_REVISIONS: tuple[str, ...] = ()
#: What the import plans of the K/V heads torch's SDPA reads (:func:`kv_heads_read`), at cp > 1.
KV_HEADS = ("cp {cp}: torch's ring attention planned moving K and V at the {at} ([memory] kv_expanded {flag}: "
            "torchtitan {rev}, the revision the import plans (training.op_sac_policy), {how}); {other}")


def kv_heads_read(spec, cp: int, revision: str, notes: list[str]) -> dict[str, bool]:
    """The ``[memory]`` keys of the K/V heads torchtitan ``revision`` (``training.op_sac_policy``) feeds
    its SDPA (:func:`meshplan.spec.axes.tp.sdpa_kv_heads`): ``kv_expanded`` true where it repeats them
    (:data:`REPEAT_KV_REVISIONS`), else none (the default, false: the KV heads); and for a GQA model
    (``spec``: its ModelSpec, None when not known) at ``cp`` > 1 the note :data:`KV_HEADS` saying which.

    >>> notes = []
    >>> from meshplan import catalog
    >>> kv_heads_read(catalog.model("llama3-70b"), 16, "238fa99", notes), notes[0][:66]
    ({}, "cp 16: torch's ring attention planned moving K and V at the 8 KV h")
    """
    expanded = revision in REPEAT_KV_REVISIONS
    if cp > 1 and spec is not None and not spec.is_mla and spec.n_kv_heads < spec.q_heads:
        q, g, r = spec.q_heads, spec.n_kv_heads, spec.q_heads // spec.n_kv_heads
        notes.append(KV_HEADS.format(
            cp=cp, at=f"{q} q heads" if expanded else f"{g} KV heads", flag=str(expanded).lower(), rev=revision,
            how="repeat_kv before SDPA" if expanded else "after ff0829c, v0.2.2: llama3 passes enable_gqa to SDPA, "
            "no repeat_kv; e347b1e models/llama3/model/model.py:201, 275, 295",
            other=f"a torchtitan {'after' if expanded else 'before'} ff0829c moves them at the "
            f"{g if expanded else q} {'KV' if expanded else 'q'} heads, its K/V all-gathers or shifts and dK/dV shifts "
            f"{r}x {'smaller' if expanded else 'larger'}: set [memory] kv_expanded = {str(not expanded).lower()} for it"))
    return {"kv_expanded": True} if expanded else {}
