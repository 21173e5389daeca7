"""Typos in a foreign file's keys: which key of a torchtitan TOML, a DeepSpeed JSON or a
Megatron-LM flag looks like a misspelling of one meshplan reads.

A field of a foreign file that meshplan does not read is listed, never refused, unless it is
a near miss of one it reads (:func:`near_miss`): a misspelt key would leave the setting at
its default and change the plan silently, so it is a one-line error naming the likely key.
:func:`edits` counts the typing errors between two names, :func:`near_miss` and the looser
:func:`loose_near_miss` find the read name one looks like, :func:`misspelt` walks dotted keys.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional


def edits(a: str, b: str) -> int:
    """Edits (insert, delete, substitute, swap of neighbours) between ``a`` and ``b``: the
    optimal string alignment distance (Damerau 1964's four typing errors).

    >>> edits("sequence-paralel", "sequence-parallel"), edits("dtpye", "dtype"), edits("steps", "seq_len")
    (1, 1, 6)
    """
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        row = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            row[j] = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                row[j] = min(row[j], prev2[j - 2] + 1)
        prev2, prev = prev, row
    return prev[-1]


def near_miss(name: str, read: Iterable[str]) -> Optional[str]:
    """The name of ``read`` that ``name`` looks like a typo of, or None: one edit
    (:func:`edits`) from a name under 8 characters, two from a longer one, its start cut
    off (``seq-len`` of ``seq-length``, 4 characters or more), or the same with ``_`` for
    ``-`` or the reverse (``tensor_model_parallel_size``). Two edits in a long name keep
    real neighbours apart (torchtitan's ``pipeline_parallel_schedule_csv`` is four from
    ``pipeline_parallel_schedule``); the few real names that close are the readers' exceptions.

    >>> near_miss("tensor_parallel_degre", ["tensor_parallel_degree", "seq_len"])
    'tensor_parallel_degree'
    >>> near_miss("seq-len", ["seq-length"]), near_miss("steps", ["seq_len", "dtype"])
    ('seq-length', None)
    >>> near_miss("tensor_model_parallel_size", ["tensor-model-parallel-size"])
    'tensor-model-parallel-size'
    """
    names = sorted(set(read))
    for r in names:
        if name != r and (edits(name, r) <= (1 if len(r) < 8 else 2) or (len(name) >= 4 and r.startswith(name))
                          or name.replace("-", "_") == r.replace("-", "_")):
            return r
    return None


def normalised(name: str) -> str:
    """``name`` lower-case without ``_`` and ``-``: the spelling a reader of a JSON key hears.

    >>> normalised("Zero_Optimization"), normalised("bf_16")
    ('zerooptimization', 'bf16')
    """
    return name.lower().replace("_", "").replace("-", "")


def loose_near_miss(name: str, read: Iterable[str]) -> Optional[str]:
    """The name of ``read`` closest to ``name`` (fewest :func:`edits`) when, both
    :func:`normalised`, they are equal, within one edit of a name under 8 characters or
    three of a longer one, or the shorter (5 characters or more) begins or ends the longer
    (``zero_optimization_config``); else None. Looser than :func:`near_miss`: for a format
    whose real keys are all known, so that each one is exempt (DeepSpeed's).

    >>> loose_near_miss("zero_optimizaton_x", ["zero_optimization", "train_batch_size"])
    'zero_optimization'
    >>> loose_near_miss("bf_16", ["bf16", "fp16"]), loose_near_miss("fp16x", ["bf16", "fp16"])
    ('bf16', 'fp16')
    >>> loose_near_miss("fp16_opt_level", ["fp16"]), loose_near_miss("my_section", ["fp16", "stage"])
    (None, None)
    """
    n = normalised(name)
    hits = []
    for r in sorted(set(read)):
        m = normalised(r)
        short, long_ = sorted((n, m), key=len)
        if name != r and (edits(n, m) <= (1 if len(m) < 8 else 3)
                          or (len(short) >= 5 and (long_.startswith(short) or long_.endswith(short)))):
            hits.append((edits(n, m), r))
    return min(hits)[1] if hits else None


def misspelt(keys: Iterable[str], read: Iterable[str], real: Iterable[str] = (),
             near: Callable[[str, Iterable[str]], Optional[str]] = near_miss) -> Optional[tuple[str, str]]:
    """(key, the read key it looks like) for the first of ``keys`` (dotted, as
    :func:`~meshplan.interop.common.flatten` writes them) that is a near miss of a key of
    ``read``, or None.
    Compared part by part: a part on the path of a read key continues; any other part is
    a typo when ``near`` (:func:`near_miss`, or :func:`loose_near_miss`) finds a read name
    in its place and the path so far is not in ``real`` (the foreign tool's own keys and
    tables that close to a read one).

    >>> read = ["parallelism.tensor_parallel_degree", "training.seq_len"]
    >>> misspelt(["training.steps", "parallelism.tensor_parallel_degre"], read)
    ('parallelism.tensor_parallel_degre', 'parallelism.tensor_parallel_degree')
    >>> misspelt(["paralelism.tensor_parallel_degree"], read)
    ('paralelism', 'parallelism')
    >>> misspelt(["optimizer.lr", "training.seqlen"], read, real=["training.seqlen"]) is None
    True
    """
    split = [r.split(".") for r in read]
    exempt = set(real)
    for key in keys:
        parts = key.split(".")
        for i, part in enumerate(parts):
            here = [r for r in split if r[:i] == parts[:i] and len(r) > i]
            names = {r[i] for r in here}
            if part in names:
                continue
            path = ".".join(parts[: i + 1])
            hit = None if path in exempt else near(part, names)
            if hit is not None:
                return path, ".".join(parts[:i] + [hit])
            break
    return None
