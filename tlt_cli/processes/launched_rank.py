"""Entry point of one rank the DeepSpeed launcher starts: `python -m tlt_cli.processes.launched_rank RUN_DIR`.

`tlt train` with `workers.hostfile` runs the launcher (launched_workers.py), which starts
this module once per rank on every node with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set. The rank reads the recipe and the driver's plan from the run directory
(launch_files.py), connects to the driver's event channel (event_channel.py) and runs the worker
body the plan names, as a spawned worker does (tlt_cli/training/worker_loop.py for the native
trainer), joining the process group with env:// from those variables: NCCL on `cuda:<LOCAL_RANK>`,
gloo with `actor.devices: cpu`.

When every rank is on one node (the launcher sets LOCAL_SIZE == WORLD_SIZE), DeepSpeed's CPU all-reduce
maps one /dev/shm segment per rank (69 MB) and never unlinks it: shared_memory.py says who does.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

from tlt_cli.processes.distributed import WorkerAddress
from tlt_cli.processes.event_channel import DriverUnreachable, connect_to_driver
from tlt_cli.processes.launch_files import LaunchFileError, body_function, read_launch_files


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


def main(arguments: list[str]) -> None:
    run_directory = Path(arguments[0])
    try:
        run_spec, plan = read_launch_files(run_directory)
    except LaunchFileError as error:
        sys.exit(f"launched rank: {error}")
    rendezvous = Path(plan.rendezvous_directory) if plan.rendezvous_directory is not None else None
    spec = run_spec.for_rank(dataclasses.replace(launched_address(), rendezvous_directory=rendezvous))
    try:
        events = connect_to_driver(plan.driver_host, plan.driver_port, bytes.fromhex(plan.authkey))
    except DriverUnreachable as error:
        sys.exit(f"rank {spec.address.rank}: {error}")
    try:
        body_function(plan.worker_body)(spec, events)
    finally:
        events.close()


if __name__ == "__main__":
    main(sys.argv[1:])
