"""Issue 19, compose: a component stopped and started again (``podman stop`` +
``podman start``, a manual stop that the restart policy leaves alone) comes
back at a new address on the compose network, and the others find it by its
service name: 8 streams in flight finish with the tokens of an undisturbed
run. To be sure the address changes, the stopped container's address is
taken by a placeholder container before the start (podman may hand the same
one back). Opt-in as the other container tests (PAGEDSERVE_CONTAINER_TESTS=1);
the compose project is the one of tests/test_container_compose.py."""
from __future__ import annotations

import json
import time

import pytest
from container_util import _skip_reason, podman, wait_serving
from e2e_util import Server, wait_all_free
from test_container_compose import Project, project, tiny_model, torch_cpu_path  # noqa: F401 - fixtures

_REASON = _skip_reason()
pytestmark = [pytest.mark.container, pytest.mark.slow,
              pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]
N_STREAMS = 8


def address(env: dict[str, str], container: str) -> tuple[str, str]:
    """(network, IP address) of a running container."""
    nets = json.loads(podman(env, "inspect", container))[0]["NetworkSettings"]["Networks"]
    name = next(iter(nets))
    return name, str(nets[name]["IPAddress"])


@pytest.mark.parametrize("victim", ["scheduler", "blockmgr", "gpuworker"])
def test_stopped_and_started_container_is_found_at_its_new_address(project: Project, tiny_model: str,  # noqa: F811
                                                                   victim: str) -> None:
    from test_chaos import longest_stall, reference, run_streams, wait_for, workload

    jobs = workload()[:N_STREAMS]
    with torch_cpu_path():
        expected = reference(tiny_model, jobs)
    server = Server(None, project.addr, {}, [])  # type: ignore[arg-type]  # what the helpers read
    c = project.container(victim)
    network, old_ip = address(project.env, c)
    placeholder = f"{project.name}_ip_placeholder"
    streams, threads = run_streams(server, jobs, timeout_s=300)
    total = sum(s["max_tokens"] for _, s in jobs)
    wait_for(lambda: sum(len(s.tokens) for s in streams) >= total // 5, 120, "a fifth of the tokens")
    assert sum(len(s.tokens) for s in streams) < total, "the workload finished before the stop"
    try:
        podman(project.env, "stop", "-t", "10", c)
        t_stop = time.monotonic()
        podman(project.env, "run", "-d", "--rm", "--name", placeholder, "--network", network, "--ip", old_ip,
               "--entrypoint", "/bin/sleep", project.env["PAGEDSERVE_IMAGE"], "600")
        podman(project.env, "start", c)
        _, new_ip = address(project.env, c)
        assert new_ip != old_ip, f"{victim} came back at its old address {old_ip}"
        for t in threads:
            t.join(300)
        assert not any(t.is_alive() for t in threads), "streams still open 300 s after the stop\n" + project.logs()
        print(f"\n{victim}: {old_ip} -> {new_ip} (podman stop + start); longest stream stall "
              f"{longest_stall(streams, t_stop):.1f} s")
        assert [s.error for s in streams] == [None] * len(jobs), project.logs()
        assert [s.tokens for s in streams] == expected
        wait_serving(project.addr, 120, project.logs)
        wait_all_free(server)
    finally:
        podman(project.env, "rm", "-f", "-t", "0", placeholder, check=False)
        podman(project.env, "start", c, check=False)  # a failed run must not leave the next one without it
