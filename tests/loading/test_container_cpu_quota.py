"""A container's CPU quota, set on the process's own control group or one above it (cgroup
v2 or v1), bounds the loader's reader threads: see [Note: a container's CPU quota]."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import fake_control_groups
from torch import nn

from adaptmem import adaptive
from adaptmem._loading import checkpoints


def _host(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, membership: str,
          files: dict[str, str], cores: int = 64) -> None:
    """A 64-core host seen through a fake /sys/fs/cgroup holding ``files`` (path under it:
    text) and a fake /proc/self/cgroup reading ``membership``."""
    fake_control_groups(monkeypatch, tmp_path, membership, files)
    monkeypatch.setattr(checkpoints, "_quota_files", None)  # found again, restored afterwards
    monkeypatch.setattr(checkpoints, "_WORKERS", None)
    monkeypatch.setattr(checkpoints.os, "sched_getaffinity", lambda pid: set(range(cores)),
                        raising=False)


def _reader_threads(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> int:
    """The reader threads a copying load starts its pool with."""
    sizes = []
    pool = checkpoints.SmallStackPool

    def counted(n: int, *args: object, **kwargs: object) -> object:
        sizes.append(n)
        return pool(n, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(checkpoints, "SmallStackPool", counted)

    def build() -> nn.Module:
        return nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)])

    path = tmp_path / "m.pt"
    source = build()
    torch.save(source.state_dict(), path)
    model = adaptive.load(build, path, device="cpu")
    assert torch.equal(model[3].weight, source[3].weight)
    assert sizes, "the load started no reader pool"
    return sizes[0]


# (membership, files under /sys/fs/cgroup, usable cores, reader threads) on 64 host cores
CONTAINERS = {
    "v2 quota on the process's own group (docker run --cpus 6)": (
        "0::/system.slice/docker-abc.scope\n",
        {"system.slice/cpu.max": "max 100000\n",
         "system.slice/docker-abc.scope/cpu.max": "600000 100000\n"}, 6, 6),
    "v2 quota seen at the root in a cgroup namespace": (
        "0::/\n", {"cpu.max": "150000 100000\n"}, 2, 4),
    "v2 quota on a parent group (a pod's limits.cpu)": (
        "0::/kubepods/pod1/box\n",
        {"kubepods/cpu.max": "max 100000\n", "kubepods/pod1/cpu.max": "1000000 100000\n",
         "kubepods/pod1/box/cpu.max": "max 100000\n"}, 10, 10),
    "v1 quota (cpu,cpuacct)": (
        "5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n",
        {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "1200000\n",
         "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
         "cpu,cpuacct/docker/cpu.cfs_quota_us": "-1\n",
         "cpu,cpuacct/docker/cpu.cfs_period_us": "100000\n"}, 12, 12),
    "v1 quota on the group seen at the root of a cpu mount": (
        "3:cpu:/docker/abc\n",
        {"cpu/cpu.cfs_quota_us": "50000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1, 4),
    "no quota": (
        "0::/user.slice\n", {"user.slice/cpu.max": "max 100000\n"}, 64, 16),
    "no quota, v1": (
        "3:cpu,cpuacct:/\n", {"cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
                              "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}, 64, 16),
    "no control groups": ("", {}, 64, 16),
    "odd contents": ("0::/\n", {"cpu.max": "a lot\n"}, 64, 16),
}


@pytest.mark.parametrize("container", CONTAINERS)
def test_the_loaders_pool_keeps_to_the_containers_cpu_quota(
        container: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # A thread per host core in a container held to a few CPUs would only be throttled.
    membership, files, cores, threads = CONTAINERS[container]
    _host(monkeypatch, tmp_path, membership, files)
    assert checkpoints._usable_cores() == cores
    assert _reader_threads(monkeypatch, tmp_path) == threads


def test_a_quota_changed_after_the_first_load_counts_at_the_next(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # docker update --cpus 8 on a running container
    _host(monkeypatch, tmp_path, "0::/box\n", {"box/cpu.max": "max 100000\n"})
    assert checkpoints._usable_cores() == 64
    (tmp_path / "cgroup" / "box" / "cpu.max").write_text("800000 100000\n")
    assert checkpoints._usable_cores() == 8


def test_the_affinity_mask_bounds_the_cores_below_a_larger_quota(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _host(monkeypatch, tmp_path, "0::/box\n", {"box/cpu.max": "800000 100000\n"}, cores=3)
    assert checkpoints._usable_cores() == 3
