"""The build lock of the compiled CPU kernels (``cpu_ops.build_locked``): a build killed
mid-way blocks no later start, and a start waits a bounded time for another process's build.

The unit tests drive ``build_locked`` (and ``load()`` with a stand-in build) on a temporary
build directory, with other processes as plain ``python`` subprocesses holding the lock: no
compiler, each a second or two. The end-to-end test loads the real extension from a copy of the
build directory that the suite builds anyway for ``test_cpu_kernels.py``.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import pytest
from torch.utils.file_baton import FileBaton

from mmserve.kernels import cpu_ops

# Takes mmserve's lock on the path in argv[1] as a building start would, says so, and sleeps.
HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
os.ftruncate(fd, 0)
os.pwrite(fd, f"{os.getpid()}\\n".encode(), 0)
print("locked", flush=True)
time.sleep(120)
"""

# Exits 0 if the lock in argv[1] is free, 1 if some process holds it.
LOCK_IS_FREE = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
except BlockingIOError:
    sys.exit(1)
"""


@pytest.fixture
def build_dir(tmp_path: Path) -> Path:
    path = tmp_path / "torch_extensions" / "mmserve_cpu_ops_test"
    path.mkdir(parents=True)
    return path


@pytest.fixture
def lock_holder(build_dir: Path):
    """Another process holding mmserve's build lock, as a start that is building would."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD_LOCK,
                             str(cpu_ops.build_lock_path(build_dir))],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture
def fresh_load(monkeypatch: pytest.MonkeyPatch, build_dir: Path):
    """``cpu_ops.load()`` as at process start, building into ``build_dir``; the module's state
    (and any module an earlier test loaded) comes back afterwards."""
    monkeypatch.setattr(cpu_ops, "_path", None)
    monkeypatch.setattr(cpu_ops, "_module", None)
    monkeypatch.setattr(cpu_ops, "_failure", None)
    monkeypatch.setattr(cpu_ops, "_built", {})
    monkeypatch.delenv(cpu_ops.KERNELS_ENV, raising=False)
    monkeypatch.setattr(cpu_ops, "_build_directory", lambda name: build_dir)
    return monkeypatch


def lock_is_free(build_dir: Path) -> bool:
    """Whether another process could take mmserve's build lock now."""
    check = subprocess.run([sys.executable, "-c", LOCK_IS_FREE,
                            str(cpu_ops.build_lock_path(build_dir))], timeout=30)
    return check.returncode == 0


def test_stale_torch_lock_is_removed_and_build_runs(build_dir: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    stale = build_dir / "lock"  # what a start killed inside torch's builder leaves
    stale.touch()

    # The old path: torch's builder fails to create its baton and waits for the file to go,
    # which nothing ever does. A daemon thread, so a regression cannot hang the test run.
    old_start = FileBaton(str(stale), wait_seconds=0.01)
    assert not old_start.try_acquire()
    waiter = threading.Thread(target=old_start.wait, daemon=True)
    waiter.start()
    waiter.join(timeout=0.5)
    assert waiter.is_alive(), "torch's FileBaton no longer waits on a stale lock file"

    def build() -> str:  # what torch's builder does with its baton, minus the compile
        baton = FileBaton(str(stale))
        assert baton.try_acquire(), "the stale torch lock is still there"
        baton.release()
        return "built"

    start = time.monotonic()
    with caplog.at_level(logging.INFO, logger=cpu_ops.logger.name):
        assert cpu_ops.build_locked(build_dir, build, timeout_s=1.0) == "built"
    assert time.monotonic() - start < 0.5
    assert not stale.exists()
    assert any("interrupted" in r.getMessage() and str(stale) in r.getMessage()
               for r in caplog.records)
    # The old waiter is freed too, and the OS lock is free again.
    waiter.join(timeout=2)
    assert not waiter.is_alive()
    assert lock_is_free(build_dir)


def test_wait_for_another_build_is_bounded_and_ends_with_its_process(
        build_dir: Path, lock_holder: subprocess.Popen, fresh_load: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    built: list[str] = []

    def build_extension(name: str, path: Path, target: tuple[str, ...]) -> ModuleType:
        built.append(name)
        return ModuleType(name)

    fresh_load.setattr(cpu_ops, "_build_extension", build_extension)
    fresh_load.setenv(cpu_ops.BUILD_TIMEOUT_ENV, "1")
    lock_path = cpu_ops.build_lock_path(build_dir)

    start = time.monotonic()
    with caplog.at_level(logging.INFO, logger=cpu_ops.logger.name):
        assert cpu_ops.load() is None  # the torch fallback
    waited = time.monotonic() - start
    assert 1.0 <= waited < 3.0, waited
    assert built == []
    reason = cpu_ops.unavailable_reason()
    assert reason.startswith("BuildLockTimeout: another process")
    assert str(lock_path) in reason and f"pid {lock_holder.pid}" in reason
    assert cpu_ops.BUILD_TIMEOUT_ENV in reason
    messages = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert any(level == logging.INFO and "Waiting up to 1 s" in msg for level, msg in messages)
    assert any(level == logging.WARNING and str(lock_path) in msg for level, msg in messages)

    # A holder killed mid-build (no chance to clean up) releases the lock with its process:
    # the next start takes it on its first try.
    lock_holder.send_signal(signal.SIGKILL)
    lock_holder.wait(timeout=10)
    fresh_load.setattr(cpu_ops, "_path", None)
    fresh_load.setenv(cpu_ops.BUILD_TIMEOUT_ENV, "0")  # no waiting at all
    start = time.monotonic()
    module = cpu_ops.load()
    assert time.monotonic() - start < 0.5
    assert isinstance(module, ModuleType) and built == [module.__name__]
    assert cpu_ops.unavailable_reason() is None


def test_failed_build_releases_the_lock(build_dir: Path, fresh_load: pytest.MonkeyPatch) -> None:
    def broken_build() -> None:
        raise RuntimeError("Error building extension 'mmserve_cpu_ops_test'")

    with pytest.raises(RuntimeError, match="Error building extension"):
        cpu_ops.build_locked(build_dir, broken_build, timeout_s=0)
    assert lock_is_free(build_dir)
    assert cpu_ops.build_locked(build_dir, lambda: "built", timeout_s=0) == "built"

    # Through load(): the failure becomes the fallback's reason, and the lock is free again.
    fresh_load.setattr(cpu_ops, "_build_extension", lambda name, path, target: broken_build())
    assert cpu_ops.load() is None
    assert "Error building extension" in cpu_ops.unavailable_reason()
    assert lock_is_free(build_dir)


@pytest.mark.parametrize("raw", ["soon", "-1", "nan"])
def test_bad_build_timeout_is_a_clear_fallback(raw: str, build_dir: Path,
                                                fresh_load: pytest.MonkeyPatch) -> None:
    fresh_load.setattr(cpu_ops, "_build_extension", lambda name, path, target: ModuleType(name))
    fresh_load.setenv(cpu_ops.BUILD_TIMEOUT_ENV, raw)
    assert cpu_ops.load() is None
    assert f"{cpu_ops.BUILD_TIMEOUT_ENV}={raw!r}" in cpu_ops.unavailable_reason()


LOAD_AND_REPORT = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from mmserve.kernels import cpu_ops
module = cpu_ops.load()
print(module.__file__ if module is not None else "None: " + str(cpu_ops.unavailable_reason()))
"""


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
def test_real_load_recovers_from_a_killed_build(tmp_path: Path) -> None:
    # The build this copies is the one test_cpu_kernels.py needs: made here if no earlier test
    # or start has made it (about a minute, once per suite; the process keeps the module).
    assert cpu_ops.load() is not None, cpu_ops.unavailable_reason()
    name = cpu_ops.build_name(cpu_ops.active_path())
    root = tmp_path / "torch_extensions"
    # copy2 keeps modification times, so ninja finds the copy up to date and compiles nothing.
    shutil.copytree(cpu_ops._build_directory(name), root / name, symlinks=True)
    (root / name / "lock").touch()  # as left by a start killed while compiling

    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(root)}
    env[cpu_ops.KERNELS_ENV] = cpu_ops.active_path().name
    # On the old path this start waits on the lock file forever: the timeout fails the test.
    result = subprocess.run([sys.executable, "-c", LOAD_AND_REPORT], env=env, timeout=60,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(root / name / f"{name}.so"), result.stderr
    assert not (root / name / "lock").exists()
    assert "interrupted" in result.stderr
    assert "Building the CPU kernels" not in result.stderr  # reused, not rebuilt


# ----------------------------------------------------------------- choosing a path
AVX2_ONLY = frozenset({"sse4_2", "avx", "avx2", "fma"})
AVX512 = AVX2_ONLY | {"avx512f", "avx512bw", "avx512_bf16"}


@pytest.mark.parametrize("flags,expected", [
    (AVX512, ["avx512", "avx2", "torch"]),
    (AVX2_ONLY, ["avx2", "torch"]),
    (frozenset({"sse4_2", "avx"}), ["torch"]),
])
def test_auto_takes_the_fastest_path_the_cpu_runs(flags, expected, fresh_load):
    fresh_load.setattr(cpu_ops, "cpu_flags", lambda: flags)
    fresh_load.setattr(cpu_ops, "_build_extension", lambda name, path, target: ModuleType(name))
    assert cpu_ops.supported_paths() == expected
    cpu_ops.load()
    assert cpu_ops.active_path().name == expected[0]
    built = cpu_ops._module
    assert (built is None) == (expected[0] == "torch")
    if built is not None:  # one build per path and CPU, named so
        assert built.__name__ == cpu_ops.build_name(cpu_ops.active_path())
        assert built.__name__.endswith("_" + expected[0])


@pytest.mark.parametrize("raw", ["torch", "0", " TORCH "])
def test_torch_path_builds_nothing(raw, fresh_load):
    def build(name, path, target):
        raise AssertionError("the torch path compiles nothing")

    fresh_load.setattr(cpu_ops, "_build_extension", build)
    fresh_load.setenv(cpu_ops.KERNELS_ENV, raw)
    assert cpu_ops.load() is None
    assert cpu_ops.active_path().name == "torch"
    assert cpu_ops.float32_linear() is None
    assert cpu_ops.unavailable_reason() == f"{cpu_ops.KERNELS_ENV}=torch"


def test_a_path_the_cpu_lacks_is_refused_saying_why(fresh_load):
    fresh_load.setattr(cpu_ops, "cpu_flags", lambda: AVX2_ONLY)
    fresh_load.setenv(cpu_ops.KERNELS_ENV, "avx512")
    with pytest.raises(ValueError, match=r"MMSERVE_CPU_KERNELS=avx512: this CPU lacks avx512f, "
                                         r"which the avx512 path needs; it runs avx2, torch"):
        cpu_ops.load()
    fresh_load.setenv(cpu_ops.KERNELS_ENV, "amx")
    with pytest.raises(ValueError, match=r"'amx' is not a CPU kernel path; choose one of auto, "
                                         r"torch, avx2, avx512"):
        cpu_ops.load()
    with pytest.raises(ValueError, match="this CPU lacks avx512f"):
        cpu_ops.select_path("avx512")


def test_a_named_path_that_does_not_build_fails_to_start(fresh_load):
    def broken_build(name, path, target):
        raise RuntimeError("Error building extension 'mmserve_cpu_ops_test'")

    fresh_load.setattr(cpu_ops, "cpu_flags", lambda: AVX2_ONLY)
    fresh_load.setattr(cpu_ops, "_build_extension", broken_build)
    fresh_load.setenv(cpu_ops.KERNELS_ENV, "avx2")
    with pytest.raises(RuntimeError, match=r"MMSERVE_CPU_KERNELS=avx2: the CPU kernels are "
                                           r"unavailable \(RuntimeError: Error building"):
        cpu_ops.load()
    fresh_load.setenv(cpu_ops.KERNELS_ENV, "auto")  # auto falls back to torch's operators
    assert cpu_ops.load() is None and cpu_ops.active_path().name == "avx2"
    assert cpu_ops.float32_linear() in (cpu_ops.OneDNNLinear, None)


def test_each_environment_keeps_a_build_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    # ninja rebuilds everything when the compile command changes, and the command names torch's
    # headers, Python's and the sources' directory: two environments sharing one build
    # directory would rebuild it in turn at every start.
    path = cpu_ops.PATHS["avx2"]
    names = []
    for version, site in (("2.13.0", "/venv-a"), ("2.13.0", "/venv-b"), ("2.14.0", "/venv-a")):
        monkeypatch.setattr(cpu_ops.torch, "__version__", version)
        monkeypatch.setattr(cpu_ops.torch, "__file__", f"{site}/torch/__init__.py")
        cpu_ops._build_signature.cache_clear()
        names.append(cpu_ops.build_name(path))
    monkeypatch.undo()
    cpu_ops._build_signature.cache_clear()
    assert len(set(names)) == 3, names
    assert cpu_ops.build_name(path) not in names
    assert cpu_ops.build_name(path) == cpu_ops.build_name(path)
