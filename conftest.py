"""Repository-level pytest configuration (kept out of the package).

``meshplan/runtime`` is meshplan's torch side: without torch, pytest's doctest collection
skips all of its modules (the tests skip through ``pytest.importorskip``), instead of a list
of the ones that import torch that would drift as modules are added.
"""

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("torch") else ["meshplan/runtime/*"]
