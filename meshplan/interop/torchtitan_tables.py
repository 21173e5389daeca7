"""torchtitan's pipeline split and [activation_checkpoint] table, read and written
(:mod:`meshplan.interop.torchtitan` maps the rest of the job TOML and names the sources).
"""

from __future__ import annotations

from typing import Any

from meshplan.errors import ConfigError
from meshplan.interop.common import model_is_mla

#: torchtitan schedule name -> meshplan schedule; torch.distributed.pipelining names.
SCHEDULES = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved1f1b": "interleaved_1f1b"}
SCHEDULE_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B"}


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


def read_recompute(d: dict, deg: dict[str, int], model: dict, notes: list[str]) -> dict[str, Any]:
    """training.recompute (and ac_freq) of torchtitan's [activation_checkpoint]: mode none and
    full as they are; selective with selective_ac_option "op" is op-level SAC (``op``), with
    an integer k every k-th layer in full (``layer``, ``ac_freq`` k; torchtitan's default
    option "2"). ``op`` is planned with tp = cp = ep = 1 and no MLA only (build_plan says why),
    so a mesh outside that is planned with Megatron-LM's selective recompute, with a note."""
    ac = d.get("activation_checkpoint", {})
    mode = ac.get("mode", "selective")
    if mode not in ("none", "selective", "full"):
        raise ConfigError("activation_checkpoint.mode", f"{mode!r} is not planned by meshplan; use none, selective "
                          f"or full")
    if mode != "selective":
        return {"recompute": mode}
    opt = str(ac.get("selective_ac_option", "2"))
    if opt == "op":
        why = [f"{a} {deg[a]}" for a in ("tp", "cp", "ep") if deg[a] > 1] + ["MLA"] * model_is_mla(model)
        if not why:
            return {"recompute": "op"}
        notes.append(f"activation_checkpoint selective_ac_option \"op\" (op-level SAC) is modelled with tp = cp = "
                     f"ep = 1 and no MLA only; with {', '.join(why)} planned as Megatron-LM's selective recompute "
                     f"(attention core recomputed, the other activations kept): more activation memory, less "
                     f"recompute time than op-level SAC")
        return {"recompute": "selective"}
    if not opt.isdigit() or int(opt) < 1:
        raise ConfigError("activation_checkpoint.selective_ac_option", f"{opt!r}; use \"op\" or a whole number "
                          f"k >= 1 (every k-th layer checkpointed in full)")
    return {"recompute": "layer", "ac_freq": int(opt)}


def write_recompute(t) -> dict[str, str]:
    """[activation_checkpoint] of ``t``: none and full as they are; op and layer as torchtitan's
    selective options "op" and "<ac_freq>"; Megatron-LM's selective (attention core), which
    torchtitan has no option for, as op-level SAC (the re-import lists the difference)."""
    if t.recompute in ("none", "full"):
        return {"mode": t.recompute}
    return {"mode": "selective", "selective_ac_option": str(t.ac_freq) if t.recompute == "layer" else "op"}
