"""Runtime: running planned meshes for real (launchers, the emulated testbed, validation)."""
