"""Test-wide setup. TRITON_INTERPRET must be set before any @triton.jit runs,
so it is decided here, before any pagedserve module is imported."""
from __future__ import annotations

import os
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The repository's benchmarks/ (outside the wheel): imported while the root is on sys.path,
# its modules are then found through the package, after pagedserve takes the root off.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
import benchmarks  # noqa: E402,F401 - imports pagedserve, which takes the repository root off sys.path before transformers looks for `kernels`
import pagedserve  # noqa: E402,F401

sys.path[:] = [p for p in sys.path if p != _ROOT]  # also where pagedserve is installed from elsewhere


@pytest.fixture(autouse=True, scope="session")
def _kernel_settings() -> None:
    """The kernels read no configuration: a worker hands them $PAGEDSERVE_CACHE/kernels and
    PAGEDSERVE_CPU_KERNEL (model_runner.configure_kernels). Tests that call them directly get
    the same, when collection imported them (checked, so other tests do not load triton)."""
    if "pagedserve.kernels.cpu_build" in sys.modules:
        from pagedserve.common.default_model import cache_dir
        from pagedserve.common.env import env_flag
        from pagedserve.kernels import cpu_build

        cpu_build.configure(cache_dir() / "kernels", enabled=bool(env_flag(cpu_build.ENV, True)))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs CUDA (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# ---------------------------------------------------------------- container tests
# Here, not in tests/container_util.py, so that test_container.py and
# test_container_compose.py share one session image build.
import shutil  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

from container_util import IMAGE, ROOT, Built, _skip_reason, podman  # noqa: E402


@pytest.fixture(scope="session")
def podman_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    conf = tmp_path_factory.mktemp("podman") / "containers.conf"
    # Debian's podman as root on this kind of host: crun fails on setrlimit and hybrid
    # cgroups, runc works; the default nofile/nproc limits are refused, 4096 is not.
    lines = ["[containers]", 'default_ulimits = ["nofile=4096:4096", "nproc=4096:4096"]']
    if shutil.which("runc"):
        lines += ["[engine]", 'runtime = "runc"']
    conf.write_text("\n".join(lines) + "\n")
    env = {**os.environ, "CONTAINERS_CONF": str(conf)}
    info = subprocess.run(["podman", "info", "--format", "{{.Host.OCIRuntime.Name}}"], capture_output=True,
                          text=True, env=env, timeout=60)
    if info.returncode != 0:
        pytest.skip(f"podman is not usable here: {info.stderr.strip()[-300:]}")
    return env


@pytest.fixture(scope="session")
def image(podman_env: dict[str, str]) -> Built:
    """scripts/build-image.sh (cached layers are reused; a source change rebuilds the last ones)."""
    if os.environ.get("PAGEDSERVE_CONTAINER_NO_BUILD") == "1" and \
            subprocess.run(["podman", "image", "exists", IMAGE], env=podman_env).returncode == 0:
        size = int(podman(podman_env, "image", "inspect", "--format", "{{.Size}}", IMAGE).strip())
        print(f"\nimage {IMAGE}: not rebuilt (PAGEDSERVE_CONTAINER_NO_BUILD=1)")
        return Built(IMAGE, 0.0, size)
    t0 = time.monotonic()
    r = subprocess.run(["nice", "-n", "10", str(ROOT / "scripts" / "build-image.sh")], capture_output=True,
                       text=True, env={**podman_env, "PAGEDSERVE_IMAGE": IMAGE}, timeout=3600, cwd=ROOT)
    assert r.returncode == 0, f"image build failed:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    built = Built(IMAGE, time.monotonic() - t0,
                  int(podman(podman_env, "image", "inspect", "--format", "{{.Size}}", IMAGE).strip()))
    print(f"\nimage {IMAGE}: built in {built.build_s:.0f} s, {built.size_bytes / 1e9:.2f} GB")
    return built
