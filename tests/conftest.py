"""Shared test fixtures: every test hermetic (its own working folder, a cache of the test session), one
thread per test process, a process group for DeepSpeed tests, and the tiny model the `tlt train` tests run.

Hermetic: each test runs in an empty working folder of its own, so whatever is in the checkout
(`runs/tiny-cpu` after README command 1) cannot change a test's outcome, and a test's relative
paths (`runs/`) never land in the checkout. The tlt cache ($TLT_CACHE_DIR) and the caches that
live under the home folder or the temporary folder ($XDG_CACHE_HOME: Hugging Face, pip; $TRITON_CACHE_DIR,
$TORCHINDUCTOR_CACHE_DIR) point at one
temporary folder of the test session: never the user's ~/.cache, but shared by the session's
tests because what it holds is dear to rebuild (DeepSpeed compiles its CPU communication op into
it, about a minute on 2 cores; tiny models and drafter warm-ups are built there once). A test
that needs a cold cache sets TLT_CACHE_DIR itself (monkeypatch.setenv), which wins over this.
Files of the repository are found from this file's folder (`REPOSITORY`), never from the
working folder.

The session leaves no DeepSpeed all-reduce buffer in /dev/shm: ranks that DeepSpeed's launcher
starts on one node map one each (69 MB) and a rank killed from outside cannot unlink its own, so
`no_shared_memory_left` removes, when the session ends, every such buffer that appeared during it
and that no live process still maps (another session's running ranks keep theirs).

Every test of the fault and hostfile files is checked for leaks (`no_leaks`, tests/leaks.py): a
process, a /dev/shm segment, a listening socket or a file in the system temporary folder left
behind fails it.

Also gives the test process a terminal's Ctrl-C: a shell starts background jobs (`pytest &`,
some CI runners) with SIGINT ignored, children inherit that, and the tests that press Ctrl-C on a
`tlt train` subprocess would then see it run on untouched.
"""

import fnmatch
import signal
from pathlib import Path

import pytest
import torch

REPOSITORY = Path(__file__).resolve().parent.parent
# the test files whose every test is checked for what it leaves behind (no_leaks)
LEAK_CHECKED_FILES = ("test_faults*.py", "test_hostfile_launch.py")

torch.set_num_threads(1)
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_left():
    """Remove the DeepSpeed /dev/shm buffers the session's ranks left, then check that none of them is left."""
    from tlt_cli.shared_memory import remove_unheld

    before = set(deepspeed_shared_buffers())
    yield
    removed = remove_unheld([path for path in deepspeed_shared_buffers() if path not in before])
    assert not [path for path in removed if path.exists()], "DeepSpeed buffers in /dev/shm could not be removed"


def deepspeed_shared_buffers() -> list[Path]:
    from tlt_cli.shared_memory import DEEPSPEED_BUFFER_PREFIX, SHARED_MEMORY_DIRECTORY

    return sorted(SHARED_MEMORY_DIRECTORY.glob(f"{DEEPSPEED_BUFFER_PREFIX}_*"))


@pytest.fixture(scope="session")
def session_caches(tmp_path_factory) -> Path:
    """The test session's cache folder (tlt's cache is its `tlt` subfolder)."""
    return tmp_path_factory.mktemp("caches")


@pytest.fixture(scope="session")
def cache_directory(session_caches) -> Path:
    """The tlt cache of the test session (compiled DeepSpeed ops, built models, drafter warm-ups)."""
    return session_caches / "tlt"


@pytest.fixture(scope="session")
def small_model(cache_directory) -> Path:
    """The briefly warmed-up tiny model folder the `tlt train` tests run (a local Hugging Face folder, as users
    point at; built once in the session's cache)."""
    from tlt_cli.models.tiny import ensure_tiny_model

    return ensure_tiny_model(cache_directory, warmup_steps=40)


@pytest.fixture(autouse=True)
def hermetic(tmp_path_factory, session_caches, cache_directory, monkeypatch) -> Path:
    """Run the test in an empty working folder of its own, with every cache in the session's temporary folder."""
    working_folder = tmp_path_factory.mktemp("cwd")
    monkeypatch.chdir(working_folder)
    monkeypatch.setenv("TLT_CACHE_DIR", str(cache_directory))
    monkeypatch.setenv("XDG_CACHE_HOME", str(session_caches))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(session_caches / "triton"))
    # torch's compile cache, else made under the system temporary folder the leak check watches
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(session_caches / "torchinductor"))
    return working_folder


@pytest.fixture(autouse=True)
def no_leaks(request, tmp_path_factory, hermetic, monkeypatch):
    """In the files LEAK_CHECKED_FILES names: fail a test that leaves a process, a /dev/shm segment, a listening
    socket or a file in the system temporary folder (tests/leaks.py), after removing what it left."""
    if not any(fnmatch.fnmatch(request.node.path.name, pattern) for pattern in LEAK_CHECKED_FILES):
        yield
        return
    from leaks import LeakWatch

    watch = LeakWatch()
    watch.start(tmp_path_factory.mktemp("system-tmp"), monkeypatch)
    yield
    left = watch.leaks()
    watch.clean_up()
    if left:
        pytest.fail("the test left behind:\n" + "\n".join(left), pytrace=False)


@pytest.fixture(scope="session")
def single_process_group(cache_directory, tmp_path_factory):
    """A world of one gloo rank, as a worker process would have, for in-process DeepSpeed tests.

    It meets in a private temporary folder (no TCP store), as the workers of a one-node run do.
    """
    from tlt_cli.processes.distributed import WorkerAddress, init_worker_process

    if not torch.distributed.is_initialized():
        init_worker_process(
            WorkerAddress(0, 1, 0, rendezvous_directory=tmp_path_factory.mktemp("rendezvous")),
            threads=1,
            extensions_dir=cache_directory / "torch_extensions",
        )
    yield
