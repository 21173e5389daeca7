"""The words a torchtitan import's batch error and note use, in the keys and units of the file it
read (newcomer trial 57 #4): a job TOML and a 9810191 config registry count the batch in sequences
(``training.local_batch_size``, ``training.global_batch_size``,
``parallelism.pipeline_parallel_microbatch_size``); a b5bcd76 registry in tokens
(``training.num_tokens_per_microbatch_per_dp_rank`` T, ``training.num_tokens_per_train_step`` G,
``parallelism.num_pp_microbatches`` m, over ``training.max_context_length`` L: torchtitan 73aed7f),
which :mod:`meshplan.interop.torchtitan_pyjob` folds into the sequence keys (T / L sequences a
micro-batch, G / L a step) before the job TOML reader (:mod:`meshplan.interop.torchtitan`) checks
them. :class:`BatchKeys` carries which spelling the file used, so that reader's messages (one text
each, here) name the file's own keys with its own numbers: sequences x L tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.errors import ConfigError
from meshplan.interop.torchtitan_flavors import LLAMA31_POSITIONS
from meshplan.mesh.validity import nearest_multiples


@dataclass(frozen=True)
class BatchKeys:
    """``ctx``: the file's ``max_context_length`` L where it counts tokens (b5bcd76's names), 0
    where it counts sequences (a job TOML, 9810191's names)."""

    ctx: int = 0

    def global_key(self) -> str:
        """The key of the global batch."""
        return "training.num_tokens_per_train_step" if self.ctx else "training.global_batch_size"

    def amount(self, sequences: int) -> str:
        """``sequences`` as the file writes them: ``100``, or ``819200 (100 x 8192)`` in tokens.

        >>> BatchKeys().amount(100), BatchKeys(8192).amount(100)
        ('100', '819200 (100 x 8192)')
        """
        return f"{sequences * self.ctx} ({sequences} x {self.ctx})" if self.ctx else str(sequences)

    def per_rank(self, local: int, micro: int, pp: int, dp: int, short: bool = False) -> str:
        """One data-parallel rank's share of a step times dp, in the file's keys: ``local`` sequences
        a rank per gradient-accumulation step, ``micro`` a micro-batch (pp > 1). ``short``: the
        keys without their table (the note's form).

        >>> BatchKeys().per_rank(4, 1, 2, 4)
        'training.local_batch_size 4 x dp 4'
        >>> BatchKeys(8192).per_rank(8, 1, 2, 4, short=True)
        'num_tokens_per_microbatch_per_dp_rank 8192 x num_pp_microbatches 8 x dp 4'
        """
        if not self.ctx:
            return f"{'' if short else 'training.'}local_batch_size {local} x dp {dp}"
        t, p = ("", "") if short else ("training.", "parallelism.")
        tokens = (micro if pp > 1 else local) * self.ctx
        pipeline = f" x {p}num_pp_microbatches {local // micro}" if pp > 1 else ""
        return f"{t}num_tokens_per_microbatch_per_dp_rank {tokens}{pipeline} x dp {dp}"


def accumulation_divides(keys: BatchKeys, global_batch: int, local: int, micro: int, pp: int, dp: int) -> None:
    """torchtitan's assertion that the global batch is whole gradient-accumulation steps of
    ``local x dp`` sequences (v0.2.2 ``torchtitan/train.py``:203, ``batch_degree`` = dp_replicate x
    dp_shard; b5bcd76 asserts it of the token counts), checked where dp is known (``dp_shard`` -1 on
    an unknown world: meshplan's own rule then); the error in the file's keys (:class:`BatchKeys`).
    With pp the micro-batch is ``pipeline_parallel_microbatch_size``, so meshplan's rule on it would
    not see it (newcomer trial nc57 #3: 100 of local 4 x dp 4 was noted as 6 steps of 16).

    >>> accumulation_divides(BatchKeys(), 96, 4, 4, 1, 4)
    >>> accumulation_divides(BatchKeys(), 100, 4, 4, 1, 4)
    Traceback (most recent call last):
    meshplan.errors.ConfigError: training.global_batch_size: 100 is not divisible by training.local_batch_size 4 x dp 4 = 16; use a multiple of 16 (96 or 112)
    >>> accumulation_divides(BatchKeys(8192), 100, 2, 2, 1, 8)
    Traceback (most recent call last):
    meshplan.errors.ConfigError: training.num_tokens_per_train_step: 819200 (100 x 8192) is not divisible by training.num_tokens_per_microbatch_per_dp_rank 16384 x dp 8 = 131072; use a multiple of 131072 (786432 or 917504)
    """
    n = local * dp
    if dp > 0 and global_batch % n:
        unit = max(keys.ctx, 1)
        near = " or ".join(str(k * unit) for k in nearest_multiples(global_batch, n))
        raise ConfigError(keys.global_key(), f"{keys.amount(global_batch)} is not divisible by "
                          f"{keys.per_rank(local, micro, pp, dp)} = {n * unit}; use a multiple of {n * unit} ({near})")


def accumulation_note(keys: BatchKeys, global_batch: int, local: int, micro: int, pp: int, dp: int) -> str:
    """The note where a pipeline step is several schedule runs (torchtitan's gradient accumulation
    under pp: ``training.pp_schedule_runs``), in the file's keys.

    >>> BatchKeys(8192).global_key()
    'training.num_tokens_per_train_step'
    >>> accumulation_note(BatchKeys(8192), 256, 8, 1, 2, 4).split(":")[0]
    'training.num_tokens_per_train_step 2097152 = 8 x num_tokens_per_microbatch_per_dp_rank 8192 x num_pp_microbatches 8 x dp 4'
    """
    accum = global_batch // (local * dp)
    total = global_batch * keys.ctx if keys.ctx else global_batch
    return (f"{keys.global_key()} {total} = {accum} x {keys.per_rank(local, micro, pp, dp, short=True)}: torchtitan "
            f"runs {accum} gradient-accumulation steps, each a pipeline schedule of {local // micro} micro-batches: "
            f"training.pp_schedule_runs = {accum}")


def fold_tokens(d: dict, notes: list[str]) -> int:
    """b5bcd76's token counts (73aed7f) as 9810191's batch keys, in ``d``
    (:mod:`~meshplan.interop.torchtitan_pyjob`'s table); the ``max_context_length`` they count in
    (:class:`BatchKeys`)."""
    tr, par = d.setdefault("training", {}), d.setdefault("parallelism", {})
    ctx = tr.pop("max_context_length", 2048)  # configs.py:51 (b5bcd76), 37, 43 below
    tokens = tr.pop("num_tokens_per_microbatch_per_dp_rank", 16384)
    step = tr.pop("num_tokens_per_train_step", -1)
    m = par.pop("num_pp_microbatches", 1)
    for key, v in (("training.max_context_length", ctx), ("training.num_tokens_per_microbatch_per_dp_rank", tokens),
                   ("parallelism.num_pp_microbatches", m)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(key, f"{v!r}; give a whole number >= 1")
    for key, v in (("training.num_tokens_per_microbatch_per_dp_rank", tokens),
                   ("training.num_tokens_per_train_step", step)):
        if v != -1 and (isinstance(v, bool) or not isinstance(v, int) or v % ctx):
            raise ConfigError(key, f"{v!r} is not a multiple of max_context_length {ctx}: meshplan plans sequences of "
                              f"{ctx} tokens; give a multiple of {ctx}")
    rows, pp = tokens // ctx, par.get("pipeline_parallel_degree", 1)
    tr |= {"seq_len": ctx, "local_batch_size": rows * (m if pp != 1 else 1)}
    tr |= {"global_batch_size": step // ctx} if step != -1 else {}
    par |= {"pipeline_parallel_microbatch_size": rows} if pp != 1 else {}
    notes.append(f"training.num_tokens_per_microbatch_per_dp_rank {tokens} = {rows} x max_context_length {ctx}: "
                 f"planned as {rows} sequence(s) of {ctx} tokens (torchtitan 73aed7f folds them into one row)")
    return ctx


def context_length(family: str | None, notes: list[str]):
    """``model_spec.max_context_length`` of a llama3 flavor (newer torchtitan registries' idiom;
    b5bcd76's is ``model_spec.model.max_context_length``, ``Decoder.Config.max_context_length``,
    models/common/decoder.py:130-137: the first attention layer's RoPE length): 131072 for every
    llama3 flavor (b5bcd76 models/llama3/__init__.py:138-349, :data:`LLAMA31_POSITIONS`), with a
    note in ``notes``; None (the field's "not read" error) for another model (``family``), whose
    lengths meshplan does not hold. The reader's ``context``
    (:func:`~meshplan.interop.torchtitan_py.function_tree`).

    >>> notes = []; context_length("llama3", notes)("8B"), context_length("qwen3", notes)("8B"), len(notes)
    (131072, None, 1)
    """
    def length(flavor: str) -> int | None:
        if family != "llama3":
            return None
        note = (f"model_spec.max_context_length read as {LLAMA31_POSITIONS}, the RoPE length of torchtitan's llama3 "
                f"{flavor} (b5bcd76 models/llama3/__init__.py:138-349)")
        notes.extend([note] if note not in notes else [])
        return LLAMA31_POSITIONS
    return length
