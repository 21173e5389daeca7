"""The torch-based runtime modules cannot be imported without torch; pytest's doctest
collection skips them there (the tests skip through ``pytest.importorskip``)."""

import importlib.util

TORCH_MODULES = ["model.py", "parallelize.py", "recorder.py", "dryrun.py", "compare.py", "checkpoint.py",
                 "worker.py", "evidence.py", "memcheck.py", "benchcomm_worker.py"]
collect_ignore = [] if importlib.util.find_spec("torch") else TORCH_MODULES
