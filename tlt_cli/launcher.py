"""The DeepSpeed launcher command for a recipe whose actor ranks span several nodes.

`read_hostfile(path)` reads a DeepSpeed hostfile (one `<host> slots=<gpus>` line per node, `#`
comments); `deepspeed_launch_command(recipe, recipe_path)` builds the argv that starts one rank
per GPU of `actor.devices` on every host with the `deepspeed` launcher. tlt's driver does not yet
run as those ranks (it spawns its worker processes itself, on one node), so `tlt train` refuses a
recipe with `workers.hostfile` and names this command instead (see docs/gpu.md, Multi node).
"""

from __future__ import annotations

from pathlib import Path

from tlt_cli.config import Recipe

LAUNCHER = "deepspeed"


class HostfileError(ValueError):
    """A hostfile that cannot be read; the message names the file and line."""


def read_hostfile(path: Path) -> list[str]:
    """Host names in file order; HostfileError for a missing file, a bad line or a repeated host."""
    if not path.is_file():
        raise HostfileError(f"{path} does not exist; write one line per node, e.g. 'node-a slots=8'.")
    hosts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        content = line.split("#", 1)[0].strip()
        if not content:
            continue
        parts = content.split()
        if len(parts) != 2 or not parts[1].startswith("slots=") or not parts[1].removeprefix("slots=").isdigit():
            raise HostfileError(f"{path} line {number} must read '<host> slots=<gpus>', got '{content}'.")
        if parts[0] in hosts:
            raise HostfileError(f"{path} line {number} repeats host {parts[0]}.")
        hosts.append(parts[0])
    if not hosts:
        raise HostfileError(f"{path} lists no host; write one line per node, e.g. 'node-a slots=8'.")
    return hosts


def deepspeed_launch_command(recipe: Recipe, recipe_path: Path) -> list[str]:
    """deepspeed --hostfile H --include host:gpus@... --no_local_rank --module tlt_cli train RECIPE."""
    hosts = read_hostfile(Path(recipe.workers.hostfile))
    gpus = ",".join(str(device) for device in recipe.actor.devices)
    include = "@".join(f"{host}:{gpus}" for host in hosts)
    # ranks read RANK / LOCAL_RANK from the environment the launcher sets, not from a --local_rank argument
    return [LAUNCHER, "--hostfile", str(recipe.workers.hostfile), "--include", include, "--no_local_rank",
            "--module", "tlt_cli", "train", str(recipe_path)]
