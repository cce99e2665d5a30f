"""Processes and devices: joining a cluster, the mesh over every device, a device's memory.

Devices: one (`data`, `model`) `Mesh` over every device of every process, batches sharded along
`data`; where parameters live is `run_setup/sharding.py`'s.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from run_setup.settings import ClusterSettings
from run_setup.sharding import DATA, MODEL, mesh_shape
from utils.errors import ConfigError


def setup_distributed(cluster: ClusterSettings) -> None:
    """Joins the other processes when the settings name a coordinator, or the environment does
    (`JAX_COORDINATOR_ADDRESS`), or JAX detects a cluster of several processes (SLURM, Open MPI,
    Kubernetes, Cloud TPU pods): then `jax.distributed.initialize()` reads it all from there."""
    if jax.distributed.is_initialized():
        return
    if cluster.coordinator_address:
        # CPU collectives across processes
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=cluster.coordinator_address,
            num_processes=cluster.num_processes,
            process_id=cluster.process_id,
        )
    elif os.environ.get("JAX_COORDINATOR_ADDRESS") or detected_cluster():
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize()


def detected_cluster() -> str | None:
    """The cluster that JAX's own detection (the one `jax.distributed.initialize()` runs) finds
    with more than one process, by name (`"slurm"`, `"ompi"`, ...), or None. A one-task job, such
    as a SLURM allocation without srun, is no cluster: it trains alone."""
    # JAX exports no public name for its detection
    from jax._src.clusters import ClusterEnv

    for cluster in ClusterEnv._cluster_types:
        if not cluster.opt_in_only_method and cluster.is_env_present():
            return cluster.name if cluster.get_process_count() > 1 else None
    return None


def make_mesh(
    devices: Sequence[jax.Device] | None = None, sharding: str = "replicated", tensor_parallel: int = 1
) -> Mesh:
    """The (`data`, `model`) mesh over `devices` (default: every device of every process): `model`
    has `tensor_parallel` devices under `sharding="fsdp_tp"` (else 1), `data` the rest.

    Raises:
      ConfigError: `tensor_parallel` does not divide the device count, or puts devices of two
        processes on one row of `data`, naming the numbers.
    """
    devices = np.array(jax.devices() if devices is None else devices)
    grid = devices.reshape(mesh_shape(devices.size, sharding, tensor_parallel))
    check_rows_within_processes(grid)
    return Mesh(grid, (DATA, MODEL))


def check_rows_within_processes(grid: np.ndarray) -> None:
    """A ConfigError where a row of the `[data, model]` device grid holds devices of several
    processes: each process reads its own rows of every batch, so devices that share rows (a
    `model` group) must share the process; else each process would put other rows into the one
    array and nothing would say so."""
    for row in grid:
        processes = sorted({device.process_index for device in row})
        if len(processes) > 1:
            local = sum(device.process_index == processes[0] for device in grid.flat)
            raise ConfigError(
                f"tensor_parallel {grid.shape[1]} groups devices of processes {processes}; each process reads "
                f"its own rows of the batch, so a group must lie in one process: pick a divisor of its {local} devices"
            )


def device_memory_bytes(mesh: Mesh) -> int:
    """The memory one device of `mesh` may use: each process asks one of its own devices (only
    those answer), and where the mesh spans several processes every process gets the smallest
    answer, so that decisions taken from it (preflight's stops, `Run.search_shardings`) are the
    same in every process even where hosts differ; a collective then, which every process calls.
    A mesh of this process's devices alone (`inference.load`'s) asks no other process."""
    devices = list(mesh.devices.flat)
    local = _local_memory_bytes(next(d for d in devices if d.process_index == jax.process_index()))
    if all(d.process_index == jax.process_index() for d in devices):
        return local
    # int32: JAX's default width
    mebibytes = multihost_utils.process_allgather(np.int32(min(local >> 20, 2**31 - 1)))
    return int(np.min(mebibytes)) << 20


def _local_memory_bytes(device: jax.Device) -> int:
    """A device's allocator limit (accelerators), else the host's RAM."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def gathered(array) -> np.ndarray:
    """A global array in full on every process."""
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def is_chief() -> bool:
    """Whether this is the first process, the one that writes the run's files."""
    return jax.process_index() == 0
