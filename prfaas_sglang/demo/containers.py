"""The demo's deployment from the built images: one container per node (``python -m prfaas_sglang.demo --containers``).

Every node runs in its own container of ``image`` (``docker/control-plane.Dockerfile``: the launcher, the router,
the kv-index and the emulated engine), started by ``podman run`` through the same launcher command a process
gets (``demo/cluster.py``'s :func:`start_deployment`, ``wrap`` prefixes). The PrfaaS container joins a network
namespace of its own (:class:`~prfaas_sglang.demo.netns.Netns`), behind a veth whose egress is shaped (``tbf``)
to the link's rate x kv_scale x speedup; the PD and control containers use the host's network at the other end
of that veth. The topology file is mounted read-only at its own path. Every container is removed at the end.
Needs root, podman (``runtime = "runc"``, ``cgroup_manager = "cgroupfs"`` where crun cannot run) and the image
built (``make images``).
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
from pathlib import Path

from prfaas_sglang.errors import ConfigError

CONTAINER_PYTHON = "python3"  # the images' interpreter (their entry point is the launcher's)


def unavailable(image: str) -> str | None:
    """None when ``image`` can be run here, else why not."""
    if shutil.which("podman") is None:
        return "needs podman"
    if os.geteuid() != 0:
        return "needs root (the PrfaaS container's network namespace)"
    if subprocess.run(["podman", "image", "exists", image], capture_output=True).returncode != 0:
        return f"image {image} is not built here (make images)"
    return None


def ulimits() -> tuple[str, ...]:
    """This process's process and file limits, as the containers' own: runc cannot set a limit above the caller's
    hard limit, and podman's defaults may be above it."""
    out: list[str] = []
    for flag, which in (("nproc", resource.RLIMIT_NPROC), ("nofile", resource.RLIMIT_NOFILE)):
        soft, hard = resource.getrlimit(which)
        if hard != resource.RLIM_INFINITY:
            out += ["--ulimit", f"{flag}={min(soft, hard)}:{hard}"]
    return tuple(out)


class Containers:
    """``podman run`` prefixes for a deployment's nodes; :meth:`remove` removes every container they started."""

    def __init__(self, image: str, tag: str, config_dir: Path):
        self.image, self.tag, self.config_dir = image, tag, config_dir
        self.names: list[str] = []

    def wrap(self, node: str, netns: str | None = None) -> tuple[str, ...]:
        """The prefix that runs ``python3 -m prfaas_sglang.launch ...`` for ``node`` in a container: the host's network,
        or the named network namespace's."""
        name = f"prfaas-{self.tag}-{node}"
        self.names.append(name)
        network = f"ns:/var/run/netns/{netns}" if netns else "host"
        return ("podman", "run", "--rm", "--name", name, "--network", network, *ulimits(),
                "-v", f"{self.config_dir}:{self.config_dir}:ro", "--entrypoint", "", self.image)

    def remove(self) -> None:
        if self.names:
            subprocess.run(["podman", "rm", "-f", "-t", "2", *self.names], capture_output=True, timeout=120)


def check(image: str) -> None:
    """Raise :class:`ConfigError` (``--containers``) unless ``image`` can run here."""
    if (why := unavailable(image)) is not None:
        raise ConfigError("--containers", why)
