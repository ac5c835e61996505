"""A real HTTP server process standing in for `sglang.launch_server` in the CPU tests.

It speaks the part of SGLang 0.5.23's HTTP API tlt uses: /health (503 while "starting", 200
after), /generate (canned token ids and SGLang-shaped meta_info, with output_token_logprobs when asked
for: token 10 + i has log-prob -(i + 1) / 10), /server_info, and the weight
update endpoints (a tensor update is refused outside a begin/end session, as in 0.5.21+). Every
path but /health needs `Authorization: Bearer <api key>`. Modes: ok, slow (healthy after
--startup-delay), hang (never listens), crash (prints an error and exits 1). --spawn-child
forks a sleeping child in the same process group and logs its pid, to test that stopping the
group leaves no orphans. --leave-files makes what a real server leaves behind, holds it while it
runs, and never removes it.

Run: python tests/sglang_fake_server.py --port 30100 --api-key KEY (or --config KEY.yaml) [--mode ok]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml

EOS_TOKEN = 2
ACCEPTED_PER_VERIFY = 2


class FakeState:
    """What the fake server remembers: start time, weight version, open session, draft quality."""

    def __init__(self, arguments: argparse.Namespace):
        self.arguments = arguments
        self.started = time.monotonic()
        self.weight_version = "default"
        self.session_role: str | None = None
        self.draft_broken = False
        self.lock = threading.Lock()


def canned_output(prompt_ids: list[int], max_new_tokens: int, stop_token_ids: list[int]) -> tuple[list[int], dict]:
    """Tokens 10, 11, ... ; prompts whose first id is even stop with the first stop token after 3 tokens."""
    if prompt_ids[0] % 2 == 0 and stop_token_ids and max_new_tokens >= 4:
        return [10, 11, 12, stop_token_ids[0]], {"type": "stop", "matched": stop_token_ids[0]}
    return [10 + index for index in range(max_new_tokens)], {"type": "length", "length": max_new_tokens}


def canned_logprob(index: int) -> float:
    """The log-prob the fake server reports for output token `index`."""
    return -(index + 1) / 10


class Handler(BaseHTTPRequestHandler):
    state: FakeState

    def log_message(self, format: str, *args: object) -> None:
        sys.stderr.write("fake-sglang: " + format % args + "\n")

    def _send(self, status: int, body: dict | None = None) -> None:
        payload = json.dumps(body or {}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _authorized(self) -> bool:
        return self.headers.get("Authorization") == f"Bearer {self.state.arguments.api_key}"

    def do_GET(self) -> None:
        if self.path in ("/health", "/health_generate"):
            starting = time.monotonic() - self.state.started < self.state.arguments.startup_delay
            self._send(503 if starting else 200)
        elif not self._authorized():
            self._send(401, {"error": "Unauthorized"})
        elif self.path == "/server_info":
            self._send(200, {"version": self.state.arguments.version})
        else:
            self._send(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        if not self._authorized():
            self._send(401, {"error": "Unauthorized"})
            return
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        routes = {
            "/generate": self._generate,
            "/begin_weight_update": self._begin,
            "/end_weight_update": self._end,
            "/update_weights_from_tensor": self._update_from_tensor,
            "/update_weights_from_disk": self._update_from_disk,
        }
        if self.path not in routes:
            self._send(404, {"detail": "Not Found"})
            return
        routes[self.path](body)

    def _generate(self, body: dict) -> None:
        sampling = body["sampling_params"]
        output_ids, finish_reason = canned_output(
            body["input_ids"], sampling["max_new_tokens"], sampling.get("stop_token_ids", [])
        )
        time.sleep(self.state.arguments.generate_delay * body["input_ids"][0])
        # one verify pass per ACCEPTED_PER_VERIFY + 1 tokens after the first (prefill) token
        verify_passes = max(1, (len(output_ids) - 1) // (ACCEPTED_PER_VERIFY + 1))
        accepted_each = 0 if self.state.draft_broken else ACCEPTED_PER_VERIFY
        histogram = [0] * (ACCEPTED_PER_VERIFY + 2)
        histogram[accepted_each] = verify_passes
        meta_info = {
            "id": body.get("rid"),
            "finish_reason": finish_reason,
            "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": len(output_ids),
            "weight_version": self.state.weight_version,
            "spec_verify_ct": verify_passes,
            "spec_num_correct_drafts": accepted_each * verify_passes,
            "spec_correct_drafts_histogram": histogram,
        }
        if body.get("return_logprob"):
            # [logprob, token id, text] per output token, as SGLang reports them (text only when asked for)
            meta_info["output_token_logprobs"] = [
                [canned_logprob(index), token, None] for index, token in enumerate(output_ids)
            ]
        self._send(200, {"output_ids": output_ids, "meta_info": meta_info})

    def _begin(self, body: dict) -> None:
        with self.state.lock:
            if self.state.session_role is not None:
                self._send(400, {"success": False, "message": "a weight-update session is already open"})
                return
            self.state.session_role = body.get("selector", "all")
        self._send(200, {"success": True, "message": "Success"})

    def _end(self, body: dict) -> None:
        with self.state.lock:
            opened, self.state.session_role = self.state.session_role, None
        self._send(
            200 if opened else 400, {"success": opened is not None, "message": "Success" if opened else "no session"}
        )

    def _update_from_tensor(self, body: dict) -> None:
        with self.state.lock:
            role = self.state.session_role
        if role is None:
            self._send(400, {"success": False, "message": "update_weights_from_tensor must run between begin and end"})
            return
        if body.get("selector") != role:
            self._send(
                400, {"success": False, "message": f"selector {body.get('selector')} differs from session {role}"}
            )
            return
        if role == "draft":
            self.state.draft_broken = self.state.arguments.break_draft_on_update
        self.state.weight_version = body["weight_version"]
        self._send(200, {"success": True, "message": "Success"})

    def _update_from_disk(self, body: dict) -> None:
        self.state.weight_version = body["weight_version"]
        self._send(200, {"success": True, "message": f"loaded {body['model_path']}", "num_paused_requests": 0})


# the maps of the /dev/shm entries the fake holds for as long as it runs, as SGLang's scheduler does
HELD_MAPS: list[mmap.mmap] = []


def hold_shared_memory(path: Path, staging_name: str | None = None) -> None:
    """Make `path` in /dev/shm and keep it mapped. With `staging_name`, as glibc's sem_open makes a named
    semaphore: made and mapped under the staging name, then linked to `path` and the staging name removed (so
    /proc/<pid>/maps shows the staging name, deleted)."""
    made = path.with_name(staging_name) if staging_name else path
    made.write_bytes(b"\0" * 64)
    with open(made, "r+b") as handle:
        HELD_MAPS.append(mmap.mmap(handle.fileno(), 64))
    if staging_name:
        os.link(made, path)
        made.unlink()


def leave_files() -> None:
    """Make what SGLang 0.5.23 leaves after a clean stop, held while the fake runs, and log each path: a
    /dev/shm/sglang_loads_*.shm, a /dev/shm/sem.mp-* (made as glibc makes a semaphore), three Unix socket files
    and two empty files in the temporary folder."""
    left = [Path(f"/dev/shm/sglang_loads_{os.getpid()}.shm"), Path(f"/dev/shm/sem.mp-fake{os.getpid()}")]
    hold_shared_memory(left[0])
    hold_shared_memory(left[1], staging_name=f"sem.fake{os.getpid()}")
    for number in range(3):
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(tempfile.mktemp(prefix=f"fake-sglang-ipc-{number}-"))
        left.append(Path(listener.getsockname()))
    for _ in range(2):
        with tempfile.NamedTemporaryFile(delete=False) as empty:
            left.append(Path(empty.name))
    for path in left:
        print(f"fake-sglang: left {path}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--api-key")
    parser.add_argument("--config", help="a YAML file with api-key, as tlt passes it to SGLang")
    parser.add_argument("--mode", choices=("ok", "slow", "hang", "crash"), default="ok")
    parser.add_argument("--startup-delay", type=float, default=0.0)
    parser.add_argument(
        "--generate-delay", type=float, default=0.0, help="seconds of decoding per unit of the first prompt id"
    )
    parser.add_argument("--version", default="0.5.23")
    parser.add_argument("--spawn-child", action="store_true")
    parser.add_argument("--break-draft-on-update", action="store_true")
    parser.add_argument("--leave-files", action="store_true")
    arguments = parser.parse_args()
    if arguments.config:
        arguments.api_key = str(yaml.safe_load(Path(arguments.config).read_text())["api-key"])
    if not arguments.api_key:
        parser.error("give --api-key or --config")
    print(f"fake-sglang: pid starting in mode {arguments.mode}", flush=True)
    print(f"fake-sglang: server pid {os.getpid()}", flush=True)
    if arguments.spawn_child:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(f"fake-sglang: child pid {child.pid}", flush=True)
    if arguments.leave_files:
        leave_files()
    if arguments.mode == "crash":
        time.sleep(0.2)
        print("RuntimeError: CUDA out of memory (fake crash for the tests)", file=sys.stderr, flush=True)
        sys.exit(1)
    if arguments.mode == "hang":
        time.sleep(600)
    if arguments.mode == "slow" and arguments.startup_delay == 0.0:
        arguments.startup_delay = 1.0
    Handler.state = FakeState(arguments)
    server = ThreadingHTTPServer(("127.0.0.1", arguments.port), Handler)
    print(f"fake-sglang: listening on 127.0.0.1:{arguments.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
