"""Test set-up shared by every test module.

Eight host devices are forced before JAX is imported anywhere, so multi-device
tests (data parallelism over a Mesh) run on this CPU-only machine.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (after XLA_FLAGS on purpose)

# The data-parallel tests compare 8 devices with 1; without the forced devices they would
# test nothing. (Fails if JAX was imported before this file, e.g. by a plugin.)
assert jax.device_count() == 8, f"expected 8 forced host devices, got {jax.device_count()}: is XLA_FLAGS set too late?"

# The NumPy references are float64; JAX code under test stays float32 unless a
# test asks otherwise.
jax.config.update("jax_default_matmul_precision", "highest")

import pytest  # noqa: E402

from tiny import tiny_config  # noqa: E402,F401  (re-exported for the tests)


@pytest.fixture(scope="session")
def shared_data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tfds")
