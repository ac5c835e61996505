"""Entry point of one rank the DeepSpeed launcher starts: `python -m tlt_cli.processes.launched_rank RUN_DIR`.

`tlt train` with `workers.hostfile` runs the launcher (launched_workers.py), which starts
this module once per rank on every node with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set. The rank reads the recipe and the driver's plan from the run directory
(launch_files.py), connects to the driver's event channel (event_channel.py) and runs the worker
body the plan names, as a spawned worker does (tlt_cli/training/worker_loop.py for the native
trainer), joining the process group with env:// from those variables: NCCL on `cuda:<LOCAL_RANK>`,
gloo with `actor.devices: cpu`.

When every rank is on one node (the launcher sets LOCAL_SIZE == WORLD_SIZE), DeepSpeed's CPU all-reduce
maps one /dev/shm segment per rank (69 MB) and never unlinks it; a rank removes its own as it exits,
or each run would leave them in memory until the machine restarts (a rank killed outright still does).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from tlt_cli.processes.distributed import WorkerAddress
from tlt_cli.processes.event_channel import DriverUnreachable, connect_to_driver
from tlt_cli.processes.launch_files import body_function, read_launch_files
from tlt_cli.processes.messages import WorkerSpec


def launched_address() -> WorkerAddress:
    """This rank's place in the job, from the variables the DeepSpeed launcher sets."""
    environment = os.environ
    return WorkerAddress(
        rank=int(environment["RANK"]),
        world_size=int(environment["WORLD_SIZE"]),
        master_port=int(environment["MASTER_PORT"]),
        master_address=environment["MASTER_ADDR"],
        local_rank=int(environment["LOCAL_RANK"]),
    )


# where DeepSpeed's shared-memory all-reduce keeps each rank's buffer, and its name: <prefix>_uid_addr_port_rank
# (SHM_BUFFER_NAME in its shm.cpp)
SHARED_MEMORY_DIRECTORY = Path("/dev/shm")
DEEPSPEED_BUFFER_PREFIX = "deepspeed_allreduce_buffer"


def deepspeed_shared_buffer(environment: Mapping[str, str]) -> Path | None:
    """This rank's DeepSpeed all-reduce buffer, named from the launcher's variables; None when the ranks span
    nodes (DeepSpeed then makes none)."""
    if environment.get("LOCAL_SIZE") != environment["WORLD_SIZE"]:
        return None
    name = "_".join(
        (
            DEEPSPEED_BUFFER_PREFIX,
            str(os.getuid()),
            environment["MASTER_ADDR"],
            environment["MASTER_PORT"],
            environment["RANK"],
        )
    )
    return SHARED_MEMORY_DIRECTORY / name


def main(arguments: list[str]) -> None:
    run_directory = Path(arguments[0])
    recipe, plan = read_launch_files(run_directory)
    rendezvous = Path(plan.rendezvous_directory) if plan.rendezvous_directory is not None else None
    spec = WorkerSpec(
        recipe=recipe,
        run_directory=run_directory,
        address=dataclasses.replace(launched_address(), rendezvous_directory=rendezvous),
        model_cache=Path(plan.model_cache),
        resume_from=Path(plan.resume_from) if plan.resume_from is not None else None,
        start_step=plan.start_step,
        drafter_init=Path(plan.drafter_init) if plan.drafter_init is not None else None,
    )
    try:
        events = connect_to_driver(plan.driver_host, plan.driver_port, bytes.fromhex(plan.authkey))
    except DriverUnreachable as error:
        sys.exit(f"rank {spec.address.rank}: {error}")
    try:
        body_function(plan.worker_body)(spec, events)
    finally:
        events.close()
        shared_buffer = deepspeed_shared_buffer(os.environ)
        if shared_buffer is not None:  # every rank has mapped it long before: unlinking leaves their maps intact
            shared_buffer.unlink(missing_ok=True)


if __name__ == "__main__":
    main(sys.argv[1:])
