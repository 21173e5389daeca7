"""Whether the netns testbed can run here (root, ``ip netns``, ``tc``), for the tests that
need it: they skip with the reason, unless MESHPLAN_REQUIRE_TESTBED=1 (CI, which runs as
root), where an unavailable testbed fails at collection instead of passing by skipping."""

from __future__ import annotations

import os

import pytest

from meshplan.runtime.testbed.netns import testbed_available

AVAILABLE, WHY = testbed_available()
if not AVAILABLE and os.environ.get("MESHPLAN_REQUIRE_TESTBED") == "1":
    raise RuntimeError(f"MESHPLAN_REQUIRE_TESTBED=1 but the testbed is unavailable: {WHY}")
needs_testbed = pytest.mark.skipif(not AVAILABLE, reason=f"testbed unavailable here (needs root, ip netns, tc): {WHY}")
