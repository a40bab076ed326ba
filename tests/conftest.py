"""Test setup: four fake CPU devices (for pmap and mesh tests), set before JAX is first imported."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
