"""Helpers the SGLang tests share: free loopback ports, launches of the fake server process, and an
importable stand-in `sglang` package whose `python -m sglang.launch_server` runs the fake server.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tlt_cli.sglang.server import ServerLaunch, write_private
from tlt_cli.sglang.server_args import api_key_config
from tlt_cli.sglang.transport import ServerEndpoint

FAKE_SERVER = Path(__file__).parent / "sglang_fake_server.py"
API_KEY = "test-key-0123"
# extra arguments for the fake server (e.g. "--mode crash"), read by the stand-in launch_server
FAKE_ARGUMENTS_VARIABLE = "TLT_FAKE_SGLANG_ARGS"


def write_stand_in_sglang(site: Path, version: str = "0.5.23") -> Path:
    """A `sglang` package (with dist-info saying `version`) under site; put site on PYTHONPATH.

    Its launch_server logs the argv it got, then runs the fake server on the --port and --config
    (the YAML holding the API key) tlt passed, plus the arguments in $TLT_FAKE_SGLANG_ARGS.
    """
    (site / "sglang").mkdir(parents=True)
    (site / "sglang" / "__init__.py").write_text("")
    (site / "sglang" / "launch_server.py").write_text(
        textwrap.dedent(f"""
        import argparse, os, runpy, sys
        print("argv:", " ".join(sys.argv[1:]), flush=True)
        parser = argparse.ArgumentParser()
        parser.add_argument("--port")
        parser.add_argument("--config")
        known, _ = parser.parse_known_args()
        extra = os.environ.get({FAKE_ARGUMENTS_VARIABLE!r}, "").split()
        sys.argv = [{str(FAKE_SERVER)!r}, "--port", known.port, "--config", known.config, *extra]
        runpy.run_path({str(FAKE_SERVER)!r}, run_name="__main__")
    """)
    )
    (site / f"sglang-{version}.dist-info").mkdir()
    (site / f"sglang-{version}.dist-info" / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n"
    )
    return site


def free_port() -> int:
    """A loopback port nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def free_port_range(count: int) -> int:
    """The first of `count` consecutive loopback ports that are all free right now."""
    for _attempt in range(50):
        base = free_port()
        if base + count <= 65535 and all(port_is_free(base + offset) for offset in range(1, count)):
            return base
    raise RuntimeError(f"no {count} consecutive free loopback ports found")


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def fake_launch(index: int, log_dir: Path, *fake_arguments: str, port: int | None = None) -> ServerLaunch:
    """A ServerLaunch that runs tests/sglang_fake_server.py with `fake_arguments` on a free port; the API key
    goes in a private --config file, as tlt passes it to SGLang."""
    port = port or free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    key_file = write_private(log_dir / f"api_key-{index}.yaml", api_key_config(API_KEY))
    command = (sys.executable, str(FAKE_SERVER), "--port", str(port), "--config", str(key_file), *fake_arguments)
    return ServerLaunch(
        endpoint=ServerEndpoint(index=index, url=f"http://127.0.0.1:{port}", api_key=API_KEY),
        command=command,
        environment=dict(os.environ),
        log_path=log_dir / f"server-{index}.log",
        ports=(port,),
    )


def wait_for_first_generation(run: subprocess.Popen, server_log: Path, seconds: float) -> None:
    """Wait until the server behind `run` logged its first `POST /generate` (a rollout has begun) and `run` is
    still alive, for at most `seconds`; fail if it did not come by then, or `run` ended first."""
    deadline = time.time() + seconds

    def generated() -> bool:
        return "POST /generate" in (server_log.read_text() if server_log.exists() else "")

    while time.time() < deadline and run.poll() is None and not generated():
        time.sleep(0.2)
    assert run.poll() is None, run.communicate()[1][-3000:]
    assert generated(), f"no POST /generate in {server_log} within {seconds:g} s"
