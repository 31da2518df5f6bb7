"""Multi-process start-up and mesh flags shared by the launchers. Every process runs the same
script; jax.distributed starts from --coordinator_address/--num_processes/--process_id, or from
a cluster environment jax recognises, else the script runs as one process. The mesh is a
preset's "mesh" section, each degree overridden by its flag (--data, --tensor, --sequence).
"""

from __future__ import annotations

import os
from typing import Optional

import jax
from absl import flags

from jaxinfer.config import MeshConfig

_COORDINATOR = flags.DEFINE_string("coordinator_address", None,
                                   "host:port of process 0's coordinator (multi-process runs).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index, 0-based.")
_DATA = flags.DEFINE_integer("data", 1, "Data-parallel degree of the mesh.")
_TENSOR = flags.DEFINE_integer("tensor", 1, "Tensor-parallel degree of the mesh.")
_SEQUENCE = flags.DEFINE_integer("sequence", 1, "Sequence-parallel degree of the mesh.")
MESH_AXES = ("data", "tensor", "sequence")  # a preset's "mesh" keys, MeshConfig's fields

# Variables by which jax.distributed recognises a cluster it can join without arguments.
_CLUSTER_ENV = ("JAX_COORDINATOR_ADDRESS", "SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE",
                "JOBSET_NAME", "TPU_WORKER_HOSTNAMES")


def initialize() -> None:
    """Starts jax.distributed from the flags or the cluster's environment; a no-op for a
    single process. Must run before anything touches a device."""
    given = [f for f in (_COORDINATOR, _NUM_PROCESSES, _PROCESS_ID) if f.value is not None]
    if given and len(given) != 3:
        raise ValueError("--coordinator_address, --num_processes and --process_id go together "
                         f"(got only {', '.join('--' + f.name for f in given)})")
    if given:
        if not 0 <= _PROCESS_ID.value < _NUM_PROCESSES.value:
            raise ValueError(f"--process_id {_PROCESS_ID.value} is outside [0, "
                             f"{_NUM_PROCESSES.value})")
        jax.distributed.initialize(coordinator_address=_COORDINATOR.value,
                                   num_processes=_NUM_PROCESSES.value,
                                   process_id=_PROCESS_ID.value)
    elif any(v in os.environ for v in _CLUSTER_ENV):
        jax.distributed.initialize()


def mesh_config(preset_mesh: Optional[dict] = None) -> Optional[MeshConfig]:
    """The preset's "mesh" section, each degree replaced by its flag where that was passed
    (a degree in neither is 1); None when every degree is 1."""
    preset_mesh = preset_mesh or {}
    mesh = MeshConfig(**{f.name: f.value if f.present else preset_mesh.get(f.name, f.value)
                         for f in (_DATA, _TENSOR, _SEQUENCE)})
    return None if (mesh.data, mesh.tensor, mesh.sequence) == (1, 1, 1) else mesh
