"""Build a side virtual environment with the real SGLang 0.5.23 for CPU serving, and print how long it took.

    python scripts/build_sglang_cpu_env.py        # -> $TLT_CACHE_DIR/sglang-cpu-env (else ~/.cache/tlt/...)
    python scripts/build_sglang_cpu_env.py --path /opt/sglang-cpu --python python3.11
    TLT_SGLANG_CPU_PYTHON=~/.cache/tlt/sglang-cpu-env/bin/python pytest -m real_sglang tests/test_sglang_real*.py

SGLang 0.5.23's full install pins torch 2.14.1, transformers 5.19 and CUDA wheels (~10 GB, and it would
replace tlt's torch), so it lives in its own environment. The build: `pip install --no-deps sglang==0.5.23`,
then SGLang's own requirements (read from the installed wheel's metadata) minus torch, CUDA and GPU-kernel
packages (`LEFT_OUT`), with torch held at 2.13.0 (the CPU wheel, the only torch that downloads nothing here)
by a constraint file. The environment runs SGLang's CPU platform:

    SGLANG_USE_CPU_ENGINE=1 SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python python -m sglang.launch_server \
        --device cpu --dtype float32 --attention-backend torch_native --sampling-backend pytorch \
        --disable-overlap-schedule ...

SGLang's kernel package (sgl_kernel, `sglang-kernel` on PyPI) has no CPU wheel, and PyPI's torchvision links
CUDA torch. Start-up imports `*_cpu` names from the first (only speculative and AMX paths call them) and
torchvision.transforms (only vision models call it); `STAND_IN_MODULES` installs modules of those names whose
every attribute is a function raising NotImplementedError, so a call SGLang really makes fails loudly instead
of computing something wrong (docs/gpu.md says exactly what they stand in for).
Point tlt at the environment with `rollout.sglang.python=<path>/bin/python`; the tests under the
`real_sglang` marker find it through $TLT_SGLANG_CPU_PYTHON or the default path.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SGLANG_VERSION = "0.5.23"
TORCH_PIN = "torch==2.13.0"
# requirements of SGLang 0.5.23 that are torch, CUDA or GPU kernels (or pull them in): not installed
LEFT_OUT = frozenset(
    {
        "torch",
        "torchaudio",
        "torchvision",
        "torchcodec",
        "torch-memory-saver",
        "cuda-python",
        "flash-attn-4",
        "flashinfer-python",
        "humming-kernels",
        "nvidia-cutlass-dsl",
        "nvidia-mathdx",
        "nvshmem4py-cu13",
        "quack-kernels",
        "sgl-deep-ep",
        "sgl-deep-gemm",
        "sgl-flash-mla",
        "sglang-kernel",
        "tilelang",
        "apache-tvm-ffi",
        "kernels",
        "timm",
        "deepseek-recipe",
        "tml-renderers",
    }
)
# imported unconditionally at start-up by SGLang's CPU path, but not in its requirements (torch's CUDA
# wheel brings it): triton's Python front end, whose decorators SGLang's modules apply at import
EXTRA = ("triton",)
# Stand-ins for two packages with no CPU build for torch 2.13.0 here, imported by SGLang at start-up and never
# called when serving a text model on the CPU paths tlt uses (torch_native attention, pytorch sampling, no
# speculation, no AMX): sgl_kernel (its `*_cpu` kernels) and torchvision (PyPI's wheel links CUDA torch;
# SGLang's config package imports torchvision.transforms for its vision models). Every attribute is a function
# that raises NotImplementedError, so a call SGLang really makes fails loudly instead of computing something.
STAND_IN_MODULES = {
    "sgl_kernel": ("__init__",),
    "torchvision": (
        "__init__",
        "io",
        "transforms/__init__",
        "transforms/functional",
        "transforms/v2/__init__",
        "transforms/v2/functional",
    ),
}
STAND_IN_SOURCE = '''"""Stand-in written by tlt's scripts/build_sglang_cpu_env.py (no CPU build of this package here).

Imported by SGLang 0.5.23 at start-up, never called when it serves a text model on CPU; every name is
a function raising NotImplementedError, so a real call fails loudly.
"""

import enum

# a version below every real release: transformers then keeps to its paths without torchvision
__version__ = "0.0.0+tlt.stand.in"


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def _not_available(name):
    def stand_in(*args, **kwargs):
        raise NotImplementedError(f"{__name__}.{name} is tlt's stand-in (no CPU build here); SGLang called it")

    stand_in.__name__ = name
    return stand_in


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _not_available(name)
'''


def default_env_path() -> Path:
    """$TLT_CACHE_DIR/sglang-cpu-env, else ~/.cache/tlt/sglang-cpu-env (tlt's cache, as models/tiny.py has it)."""
    return Path(os.environ.get("TLT_CACHE_DIR", Path.home() / ".cache" / "tlt")) / "sglang-cpu-env"


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def run(command: list[str]) -> None:
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True)


def sglang_requirements(env_python: Path) -> list[str]:
    """SGLang's unconditional requirements for this platform, as the installed wheel's metadata lists them."""
    probe = (
        "import importlib.metadata as m, packaging.requirements as r\n"
        "for line in m.requires('sglang') or []:\n"
        "    req = r.Requirement(line)\n"
        "    if req.marker is None or req.marker.evaluate({'extra': ''}):\n"
        "        print(str(req).split(';')[0].strip())\n"
    )
    output = subprocess.run([str(env_python), "-c", probe], check=True, capture_output=True, text=True).stdout
    return [line for line in output.splitlines() if line]


def requirement_name(requirement: str) -> str:
    return normalized(re.split(r"[\[<>=!~ ;]", requirement, maxsplit=1)[0])


def write_stand_ins(site_packages: Path) -> None:
    for package, modules in STAND_IN_MODULES.items():
        for module in modules:
            path = site_packages / package / f"{module}.py"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(STAND_IN_SOURCE)


def build(env_path: Path, python: str) -> float:
    started = time.perf_counter()
    run([python, "-m", "venv", str(env_path)])
    env_python = env_path / "bin" / "python"
    pip = [str(env_python), "-m", "pip", "install", "--quiet"]
    run([*pip, "packaging"])
    run([*pip, "--no-deps", f"sglang=={SGLANG_VERSION}"])
    kept = [req for req in sglang_requirements(env_python) if requirement_name(req) not in LEFT_OUT]
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as constraints:
        constraints.write(TORCH_PIN + "\n")
    run([*pip, "-c", constraints.name, TORCH_PIN, *kept, *EXTRA])
    os.unlink(constraints.name)
    site_packages = Path(
        subprocess.run(
            [str(env_python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    write_stand_ins(site_packages)
    check = "import sglang, torch; print('sglang', sglang.__version__, 'torch', torch.__version__)"
    run([str(env_python), "-c", check])
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", type=Path, default=default_env_path(), help="where to build the environment")
    parser.add_argument("--python", default="python3.11", help="interpreter to build it from (3.10-3.12)")
    parser.add_argument("--force", action="store_true", help="rebuild over an existing environment")
    args = parser.parse_args()
    if (args.path / "bin" / "python").exists() and not args.force:
        print(f"{args.path} exists; --force rebuilds it. Use rollout.sglang.python={args.path}/bin/python")
        return
    seconds = build(args.path, args.python)
    size = subprocess.run(["du", "-sh", str(args.path)], capture_output=True, text=True).stdout.split()[0]
    print(f"built {args.path} in {seconds:.0f} s ({size})")
    print(f"tlt: rollout.sglang.python={args.path}/bin/python   tests: TLT_SGLANG_CPU_PYTHON={args.path}/bin/python")


if __name__ == "__main__":
    sys.exit(main())
