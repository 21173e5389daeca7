"""The ``reshard_after_forward`` position of the search's tie key (:func:`meshplan.search.tie_key.knob_key`):
whether the setting is off its default at the mesh, the default being
:meth:`~meshplan.spec.training.TrainingSpec.reshard_default` (true; false under torch's FSDP2 with pp
> 1, as torchtitan runs it), with the word that names the value where the rule prints it
(:func:`meshplan.search.rank.decide`, :func:`meshplan.search.tie_key.knob_words`).
"""

from __future__ import annotations

from typing import Optional


class ReshardKey(int):
    """The ``reshard_after_forward`` position of a tie key (:func:`~meshplan.search.tie_key.knob_key`): 1 where the setting
    is off the mesh's default, else 0 (also where it acts on nothing: no FSDP over a data axis), and
    it compares and hashes as that int, so two meshes at their own defaults tie on it whichever way
    those go (pp 2 kept gathered and cp 2 resharded under torch); ``word`` names the value for
    :func:`~meshplan.search.rank.decide` and :func:`~meshplan.search.tie_key.knob_words`: ``kept gathered``, ``resharded`` or :data:`NO_RESHARD`.

    >>> k = ReshardKey(False, "kept gathered")
    >>> k == 0, k == ReshardKey(False, "resharded"), k.word, ReshardKey(True, "resharded") > k
    (True, True, 'kept gathered', True)
    """

    word: str

    def __new__(cls, off: bool, word: str):
        key = super().__new__(cls, int(off))
        key.word = word
        return key

    def __getnewargs__(self):  # pickled with its word (the search's worker processes)
        return bool(self), self.word


#: :class:`ReshardKey`'s word where the setting acts on nothing (no FSDP over a data axis).
NO_RESHARD = "no FSDP data axis"


def reshard_value(v: int) -> str:
    """A :class:`ReshardKey` as :func:`~meshplan.search.rank.decide` prints it: its word, after
    ``default`` where it is the mesh's default (``default kept gathered`` under torch with pp > 1);
    a plain int (a key built by hand) as off the default or not.

    >>> reshard_value(ReshardKey(False, "kept gathered")), reshard_value(ReshardKey(True, "resharded"))
    ('default kept gathered', 'resharded')
    """
    word = getattr(v, "word", None)
    if word is None:
        return "off the default" if v else "default"
    return word if v or word == NO_RESHARD else f"default {word}"


def reshard_key(reshard: Optional[bool], default: bool) -> ReshardKey:
    """The :class:`ReshardKey` of a setting ``reshard`` (None: acts on nothing) at its ``default``."""
    if reshard is None:
        return ReshardKey(False, NO_RESHARD)
    return ReshardKey(reshard != default, "resharded" if reshard else "kept gathered")
