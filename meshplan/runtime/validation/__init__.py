"""Validation: ``meshplan validate`` (:mod:`.validate`), the comparison of recorded collectives
with the plan (:mod:`.compare`), evidence (:mod:`.evidence`), the in-run probe (:mod:`.probe`),
step parts (:mod:`.breakdown`), the measured slice (:mod:`.slice`), fake-process-group checks
(:mod:`.dryrun`, :mod:`.memcheck`) and kernel timing (:mod:`.kerneltimes`).
"""

__all__ = ["breakdown", "compare", "dryrun", "evidence", "kerneltimes", "memcheck", "probe", "slice", "validate"]
