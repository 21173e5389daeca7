"""Megatron-LM's attention kernel flags and ``training.flash_attention``, their one home.

NVIDIA/Megatron-LM d98e8a6 chooses the attention kernel by ``--attention-backend`` (the
``TransformerConfig.attention_backend`` field, an ``AttnBackend`` of
``megatron/core/transformer/enums.py``: flash, fused, unfused, local, auto; default auto).
``LanguageModule._set_attention_backend`` (``megatron/core/models/common/language_module/
language_module.py``) turns it into Transformer Engine's switches: flash sets NVTE_FLASH_ATTN=1
alone, fused NVTE_FUSED_ATTN=1 (cuDNN's fused attention) alone, auto both (TE picks), unfused
NVTE_UNFUSED_ATTN=1 alone and local none (Megatron-Core's own DotProductAttention). The first
three run a fused kernel that never holds the score matrix (meshplan's ``flash_attention =
true``, timed from the catalog's attention rows); unfused and local materialise the scores
(``flash_attention = false``). ``--use-flash-attn`` is still a switch of ``arguments.py`` at
d98e8a6 but nothing reads it there (the backend decides).

On export (:func:`written_attention`) the plan's choice is one flag: a user's
``--attention-backend`` that agrees with the plan is carried as given, in place of the
``--use-flash-attn`` or ``--attention-backend unfused`` the writer puts for ``flash_attention``.
"""

from __future__ import annotations

from meshplan.errors import ConfigError

FLAG = "--attention-backend"
#: AttnBackend (enums.py at d98e8a6) -> whether the kernel is fused (meshplan's flash_attention).
BACKENDS = {"flash": True, "fused": True, "unfused": False, "local": False, "auto": True}
#: Megatron-DeepSpeed's FlashAttention-2 switch (its arguments.py: ``--use-flash-attn`` is an alias of
#: ``--use-flash-attn-v1`` there); not a Megatron-LM flag, carried on export as the user's.
FLASH_V2 = "--use-flash-attn-v2"
#: Megatron-DeepSpeed's flash-attention switches (f4157be ``megatron/arguments.py:927-935``: ``--use-flash-attn``
#: is ``--use-flash-attn-v1``).
MDS_FLASH = ("--use-flash-attn", "--use-flash-attn-v1", FLASH_V2, "--use-flash-attn-triton", "--use-flash-attn-builder")
#: What the writer puts for ``flash_attention`` true / false (megatron_write).
WRITTEN = {True: "--use-flash-attn", False: f"{FLAG} unfused"}


def read_attention(args: dict, low_precision: bool, notes: list[str], deepspeed: bool = False) -> dict[str, bool]:
    """``{"flash_attention": ...}`` of ``args`` (parsed Megatron-LM arguments) by
    ``--attention-backend``; without it Megatron-LM's auto (a fused kernel, true), with a note
    where neither it nor ``--use-flash-attn`` is given in a bf16 or fp16 run (``low_precision``).
    A value outside AttnBackend is a ConfigError naming the flag. Megatron-DeepSpeed's arguments
    (``deepspeed``: ``--deepspeed`` given) without ``--attention-backend``: flash attention only with
    one of :data:`MDS_FLASH` (microsoft/Megatron-DeepSpeed f4157be ``megatron/model/transformer.py:528-531``:
    ``use_flash_attn`` is those switches; without them its ``CoreAttention`` materialises the scores,
    baddbmm and the fused softmax), with a note.

    >>> read_attention({"--attention-backend": "flash"}, True, []), read_attention({FLAG: "local"}, True, [])
    ({'flash_attention': True}, {'flash_attention': False})
    >>> read_attention({}, True, [], deepspeed=True), read_attention({FLASH_V2: True}, True, [], deepspeed=True)
    ({'flash_attention': False}, {'flash_attention': True})
    """
    value = args.get(FLAG)
    if value is None and deepspeed:
        flash = any(args.get(f) for f in MDS_FLASH)
        if not flash:
            notes.append(f"Megatron-DeepSpeed without {' / '.join(MDS_FLASH)}: its CoreAttention (the scores "
                         f"materialised, baddbmm and the fused softmax): training.flash_attention = false")
        return {"flash_attention": flash}
    if value is None:
        if low_precision and not args.get("--use-flash-attn") and not args.get(FLASH_V2):
            notes.append(f"{FLAG} not given: planned with a fused attention kernel (Megatron-Core's default auto: "
                         f"Transformer Engine picks flash or cuDNN fused attention)")
        return {"flash_attention": True}
    if value not in BACKENDS:
        raise ConfigError(FLAG, f"{value!r}; use one of {', '.join(BACKENDS)} (AttnBackend, Megatron-LM d98e8a6)")
    if not BACKENDS[value]:
        notes.append(f"{FLAG} {value}: planned with the attention scores materialised (training.flash_attention "
                     f"= false)")
    return {"flash_attention": BACKENDS[value]}


def written_attention(user: dict, written: list[str]) -> tuple[list[str], bool]:
    """(``written`` without the writer's attention flag, True) where the user's arguments give
    an ``--attention-backend`` of the kind the export writes (fused or not, :data:`WRITTEN`) and
    no ``--use-flash-attn`` of their own, so that the user's flag, carried, says it once; else
    (``written``, False).

    >>> written_attention({FLAG: "flash"}, ["--bf16", "--use-flash-attn"])
    (['--bf16'], True)
    >>> written_attention({FLAG: "local"}, ["--bf16", "--use-flash-attn"])
    (['--bf16', '--use-flash-attn'], False)

    Megatron-DeepSpeed's ``--use-flash-attn-v2`` (:data:`FLASH_V2`), carried, stands for the writer's
    ``--use-flash-attn``, which is FlashAttention 1 there (``--use-flash-attn-v1``'s alias):

    >>> written_attention({FLASH_V2: True}, ["--bf16", "--use-flash-attn"])
    (['--bf16'], False)
    """
    value = user.get(FLAG)
    if user.get(FLASH_V2) and WRITTEN[True] in written:  # the user's FlashAttention-2 switch says it
        return [w for w in written if w != WRITTEN[True]], False
    if value not in BACKENDS or user.get("--use-flash-attn") or WRITTEN[BACKENDS[value]] not in written:
        return written, False
    return [w for w in written if w != WRITTEN[BACKENDS[value]]], True
