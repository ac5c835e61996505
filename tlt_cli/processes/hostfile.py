"""Hostfiles and the DeepSpeed launcher command that runs a recipe's actor ranks on them.

`read_hostfile(path)` reads a DeepSpeed hostfile (one `<host> slots=<n>` line per node, `#`
comments); `hostfile_problem(recipe)` says, in one sentence, why it does not fit the recipe (None when it
does; the recipe gate, tlt_cli/recipe_checks.py, refuses the recipe with it);
`deepspeed_launch_command(recipe, run_directory, master_port)` builds the argv the driver runs
(launched_workers.py): DeepSpeed's launcher starts `python -m tlt_cli.processes.launched_rank
RUN_DIR` as every rank, one per GPU of `actor.devices` on each host, or one per slot with
`actor.devices: cpu`.

What DeepSpeed 0.19's launcher does with a hostfile (read in its runner): it checks passwordless
ssh to the first host and asks it for its address (`ssh host hostname -I`), unless told
`--no_ssh_check` and `--master_addr`; then, if only one host is left, it starts the ranks on this
machine (no ssh, no pdsh), otherwise through pdsh (`--launcher` picks another backend). So a
one-host hostfile runs locally with the first two flags; several hosts need pdsh and ssh. pdsh's
remote command is one shell line: `cd <working folder>; <python> -u -m deepspeed.launcher.launch ...
<run directory>`, with the paths unquoted, so `shell_paths(recipe)` lists those paths (resolved as
the command resolves them) for the recipe gate to refuse any a shell would read as more than itself.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from tlt_cli.atomic_files import not_a_file
from tlt_cli.config import CPU_DEVICES, Recipe

# the module every launched rank runs
RANK_MODULE = "tlt_cli.processes.launched_rank"
LOCAL_ADDRESS = "127.0.0.1"


class HostfileError(ValueError):
    """A hostfile that cannot be read; the message names the file and line."""


@dataclass(frozen=True)
class Host:
    """One line of a hostfile: a node and how many ranks (GPUs, or CPU processes) it offers."""

    name: str
    slots: int


def read_hostfile(path: Path) -> list[Host]:
    """Hosts in file order; HostfileError for a missing file, a bad line or a repeated host."""
    if not path.is_file():
        raise HostfileError(f"{path} {not_a_file(path)}; write one line per node, e.g. 'node-a slots=8'.")
    hosts: list[Host] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        content = line.split("#", 1)[0].strip()
        if not content:
            continue
        parts = content.split()
        slots = parts[1].removeprefix("slots=") if len(parts) == 2 else ""
        if not parts[-1].startswith("slots=") or not slots.isdigit() or int(slots) < 1:
            raise HostfileError(f"{path} line {number} must read '<host> slots=<n>' with n >= 1, got '{content}'.")
        if parts[0] in [host.name for host in hosts]:
            raise HostfileError(f"{path} line {number} repeats host {parts[0]}.")
        hosts.append(Host(parts[0], int(slots)))
    if not hosts:
        raise HostfileError(f"{path} lists no host; write one line per node, e.g. 'node-a slots=8'.")
    return hosts


def hostfile_problem(recipe: Recipe) -> str | None:
    """Why the hostfile cannot be read, or why its nodes do not give exactly workers.count ranks (one per GPU or
    CPU slot), in one sentence naming the file; None when they do."""
    path = Path(recipe.workers.hostfile)
    try:
        hosts = read_hostfile(path)
    except HostfileError as error:
        return str(error)
    devices = recipe.actor.devices
    if devices == CPU_DEVICES:
        if len({host.slots for host in hosts}) > 1:
            return (
                f"{path} gives hosts different slots; with actor.devices cpu every node runs the same "
                "number of ranks, one per slot."
            )
        ranks, why = sum(host.slots for host in hosts), f"the slots of {path}, one CPU rank each"
    else:
        short = [host for host in hosts if host.slots <= max(devices)]
        if short:
            return (
                f"{path} gives {short[0].name} slots={short[0].slots}, but actor.devices uses GPU "
                f"{max(devices)}; slots must count the node's GPUs."
            )
        ranks, why = len(hosts) * len(devices), f"{len(hosts)} nodes in {path} x {len(devices)} actor.devices each"
    if recipe.workers.count != ranks:
        return f"workers.count must be {ranks} ({why}), got {recipe.workers.count}."
    return None


def ranks_per_node(recipe: Recipe) -> int:
    """Worker ranks on each node: all of them without a hostfile, else one per GPU (or per CPU slot)."""
    if recipe.workers.hostfile is None:
        return recipe.workers.count
    if recipe.actor.devices != CPU_DEVICES:
        return len(recipe.actor.devices)
    return read_hostfile(Path(recipe.workers.hostfile))[0].slots


def runs_on_this_machine(recipe: Recipe) -> bool:
    """Whether the launcher starts every rank here (a one-host hostfile: DeepSpeed's local path)."""
    return len(read_hostfile(Path(recipe.workers.hostfile))) == 1


def shell_paths(recipe: Recipe) -> list[tuple[str, str]]:
    """(what, absolute path) of every path a hostfile launch's remote shell line carries: the working folder (the
    launcher cds there on every node), this interpreter and the run directory, resolved as the command is."""
    run_directory = Path(recipe.run.output_dir).expanduser() / recipe.run.name
    try:
        resolved = run_directory.resolve()
    except (OSError, RuntimeError):  # a symlink loop or an unreadable part: the folder checks name it
        resolved = run_directory.absolute()
    return [
        ("the working folder", os.getcwd()),
        ("the Python interpreter", sys.executable),
        ("the run directory", str(resolved)),
    ]


def deepspeed_launch_command(recipe: Recipe, run_directory: Path, master_port: int) -> list[str]:
    """The DeepSpeed launcher (its `deepspeed` command, run by this interpreter) starting every rank of the run."""
    hostfile = Path(recipe.workers.hostfile)
    command = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--hostfile",
        str(hostfile.resolve()),
        "--master_port",
        str(master_port),
    ]
    if recipe.actor.devices != CPU_DEVICES:
        gpus = ",".join(str(device) for device in recipe.actor.devices)
        command += ["--include", "@".join(f"{host.name}:{gpus}" for host in read_hostfile(hostfile))]
    if runs_on_this_machine(recipe):
        # one host: DeepSpeed launches locally, so neither its ssh check nor its ssh address lookup applies
        command += ["--no_ssh_check", "--master_addr", LOCAL_ADDRESS]
    # ranks read RANK / LOCAL_RANK from the environment the launcher sets, not from a --local_rank argument
    return [*command, "--no_local_rank", "--module", RANK_MODULE, str(run_directory.resolve())]
