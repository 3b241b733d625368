from __future__ import annotations

import mmap
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import fake_control_groups
from torch import nn

from adaptmem import PlacementError, adaptive, cpu_memory
from adaptmem._common.devices import capacity


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )


def test_a_real_cpu_oom_under_the_cap_adapts_and_gives_the_right_answer() -> None:
    result = _run(
        """
        import logging, sys, torch
        from adaptmem import adaptive
        logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
        adaptive.cpu_memory.set_cpu_memory_limit(1.5)
        data = torch.arange(4096, dtype=torch.float64)

        @adaptive.batch(initial_batchsize=4096)
        def total(batchsize, data):
            out = 0.0
            for i in range(0, len(data), batchsize):
                chunk = data[i:i + batchsize]
                # 512 KiB of scratch per item: 4096 items want 2 GiB, over the cap.
                scratch = chunk.view(-1, 1).expand(-1, 65536).clone()
                out += float(scratch[:, 0].sum())
            return out

        print("RESULT", total(data), float(data.sum()))
        """
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    got, want = next(line for line in lines if line.startswith("RESULT")).split()[1:]
    assert float(got) == float(want)
    assert any("ran out of memory at batchsize=4096" in line for line in lines), result.stdout


def test_a_tight_cap_set_before_any_parallel_op_still_adapts() -> None:
    # Each thread OpenMP starts maps a stack the cap counts; one started after the cap, once
    # an attempt has used the room, ended the whole process ("libgomp: Thread creation
    # failed") instead of raising an error the decorator adapts to.
    result = _run(
        """
        import logging, sys, torch
        from adaptmem import adaptive
        from adaptmem.cpu_memory import held_bytes, set_cpu_memory_limit
        logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
        torch.set_num_threads(2)
        set_cpu_memory_limit(held_bytes() / 2**30 + 0.25)
        w = torch.randn(64, 8000)

        @adaptive.batch(initial_batchsize=16384)
        def f(batchsize):
            return (torch.randn(batchsize, 64) @ w).shape[0]

        print("RESULT", f())
        """
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "ran out of memory at batchsize=16384" in result.stdout, result.stdout
    assert "RESULT" in result.stdout


def test_the_cap_fails_real_allocations_and_reports_what_is_left() -> None:
    result = _run(
        """
        import torch
        from adaptmem import adaptive
        adaptive.cpu_memory.set_cpu_memory_limit(1.0)
        from adaptmem.cpu_memory import cpu_memory_info
        print("TOTAL", cpu_memory_info()[1])
        before = adaptive.cpu_memory.get_available_cpu_memory()
        block = torch.ones(256 * 2**20 // 4)
        after = adaptive.cpu_memory.get_available_cpu_memory()
        try:
            torch.empty(2 * 2**30, dtype=torch.uint8)
            print("ALLOCATED")
        except RuntimeError as exc:
            print("REFUSED", adaptive.is_oom(exc))
        adaptive.cpu_memory.set_cpu_memory_limit(None)
        big = torch.empty(2 * 2**30, dtype=torch.uint8)
        print("LIFTED", before, after)
        """
    )
    assert result.returncode == 0, result.stderr
    assert "REFUSED True" in result.stdout and "LIFTED" in result.stdout
    assert int(result.stdout.split("TOTAL")[1].split()[0]) == 2**30  # the cap asked for
    before, after = map(int, result.stdout.split("LIFTED")[1].split())
    assert before < 1.0 * 2**30
    assert 200 * 2**20 <= before - after <= 320 * 2**20


@pytest.mark.parametrize("bad", [0, -1, "8", True, float("inf"), float("nan"), 1e30])
def test_bad_caps_are_refused_with_the_fix(bad: object) -> None:
    with pytest.raises(ValueError, match="gib"):
        adaptive.cpu_memory.set_cpu_memory_limit(bad)  # type: ignore[arg-type]


def test_a_cap_below_what_is_already_held_is_refused() -> None:
    with pytest.raises(ValueError, match="already holds"):
        adaptive.cpu_memory.set_cpu_memory_limit(0.001)


def test_adaptmem_imports_without_the_resource_module_and_only_the_cap_refuses() -> None:
    # Windows has no resource module; psutil's Linux module needs it, Windows' does not.
    result = _run("""
        import sys
        import psutil
        sys.modules["resource"] = None
        from adaptmem import adaptive
        print("AVAILABLE", adaptive.cpu_memory.get_available_cpu_memory() > 0)
        try:
            adaptive.cpu_memory.set_cpu_memory_limit(8)
        except OSError as exc:
            print("REFUSED", exc)
    """)
    assert result.returncode == 0, result.stderr
    assert "AVAILABLE True" in result.stdout
    assert "REFUSED set_cpu_memory_limit needs Linux" in result.stdout


def test_available_memory_without_a_cap_is_what_the_machine_reports() -> None:
    import psutil

    available = adaptive.cpu_memory.get_available_cpu_memory()
    assert 0 < available <= psutil.virtual_memory().total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux only)")
def test_held_memory_is_what_the_cap_counts_and_grows_with_a_touched_allocation() -> None:
    import torch

    def rss_anon() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

    before = adaptive.cpu_memory.held_bytes()
    assert abs(before - rss_anon()) < 4 * 2**20
    # A fresh anonymous mapping, every page touched: a tensor could reuse memory an earlier
    # test freed and the allocator kept resident, which would not grow what the process holds.
    block = mmap.mmap(-1, 64 * 2**20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    torch.frombuffer(block, dtype=torch.uint8).fill_(1)
    assert adaptive.cpu_memory.held_bytes() - before > 60 * 2**20
    block.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_DATA (Linux only)")
def test_a_checkpoint_mapped_under_the_cap_does_not_count_against_it(tmp_path: Path) -> None:
    import torch

    # 96 MiB of weights in the file, a 48 MiB cap: RLIMIT_DATA alone would refuse the mapping
    # (a private writable one counts at its whole length); see [Note: file mappings and the cap].
    torch.save(nn.Sequential(*[nn.Linear(2048, 4096) for _ in range(3)]).state_dict(),
               tmp_path / "model.pt")
    result = _run(
        f"""
        import ctypes, gc, resource, torch
        from torch import nn
        from adaptmem import adaptive
        from adaptmem.cpu_memory import cpu_memory_info, held_bytes, set_cpu_memory_limit
        ctypes.CDLL("libc.so.6").mallopt(-3, 128 << 10)  # large blocks unmapped when freed
        meta = adaptive.empty_model(
            lambda: nn.Sequential(*[nn.Linear(2048, 4096) for _ in range(3)]))
        set_cpu_memory_limit((held_bytes() + (48 << 20)) / 2**30)
        limit = resource.getrlimit(resource.RLIMIT_DATA)[0]
        model, stats = adaptive.load(meta, {str(tmp_path / "model.pt")!r}, device="cpu",
                                     copy=False, return_stats=True)
        free = cpu_memory_info()[0]
        y = model[0](torch.ones(2, 2048))  # the mapped weights are read
        print("MAPPED", stats.bytes_mapped, free, float(y.sum()) != 0)
        try:
            torch.empty(64 << 20, dtype=torch.uint8)
            print("CAP LOST")
        except RuntimeError:
            print("CAP HOLDS")
        del model, meta, stats, y
        gc.collect()
        print("LIMIT BACK", resource.getrlimit(resource.RLIMIT_DATA)[0] == limit)
        """
    )
    assert result.returncode == 0, result.stderr
    mapped, free, read = result.stdout.split("MAPPED")[1].split()[:3]
    assert int(mapped) >= 96 << 20 and read == "True"
    assert 40 << 20 < int(free) <= 48 << 20  # the mapping took none of the cap
    assert "CAP HOLDS" in result.stdout  # and the cap still refuses more than it allows
    assert "LIMIT BACK True" in result.stdout  # the limit came down when the mapping went


def test_a_numpy_number_is_a_cap_like_any_number() -> None:
    import numpy as np

    try:
        adaptive.cpu_memory.set_cpu_memory_limit(np.int64(64))  # type: ignore[arg-type]
        assert adaptive.cpu_memory.get_available_cpu_memory() > 0
    finally:
        adaptive.cpu_memory.set_cpu_memory_limit(None)


MiB = 2**20


_control_groups = fake_control_groups


def _linears(count: int) -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(*[nn.Linear(4096, 4096, bias=False) for _ in range(count)])


def test_a_containers_memory_limit_bounds_free_cpu_memory_and_the_plans_capacity(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # docker run -m 1g, 200 MiB in use: the machine's figures would offer it all.
    _control_groups(monkeypatch, tmp_path, "0::/\n", {
        "memory.max": f"{1024 * MiB}\n", "memory.current": f"{200 * MiB}\n",
        "memory.stat": "anon 209715200\ninactive_file 0\n"})
    assert adaptive.cpu_memory.get_available_cpu_memory() == 824 * MiB
    assert adaptive.cpu_memory.cpu_memory_info()[1] == 1024 * MiB
    assert capacity(torch.device("cpu")) == 1024 * MiB
    # "auto": free less the reserve (half of what is free, with so little): 412 MiB.
    assert adaptive.plan(_linears(4), devices={"cpu": "auto"}).device_map == {"": "cpu"}
    with pytest.raises(PlacementError, match="its capacity is 412.0 MiB"):
        adaptive.plan(_linears(8), devices={"cpu": "auto"})  # 512 MiB


def test_reclaimable_page_cache_in_a_container_counts_as_free(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # A checkpoint read in the container leaves its pages in the group's usage.
    _control_groups(monkeypatch, tmp_path, "0::/\n", {
        "memory.max": f"{1024 * MiB}\n", "memory.current": f"{900 * MiB}\n",
        "memory.stat": f"anon {300 * MiB}\nactive_file 0\ninactive_file {600 * MiB}\n"})
    assert adaptive.cpu_memory.get_available_cpu_memory() == 724 * MiB


@pytest.mark.parametrize("v1", [False, True])
def test_page_cache_read_twice_counts_as_free_but_not_mapped_weights(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, v1: bool) -> None:
    # A checkpoint read twice: its pages are active, and stay charged to the group after
    # the process ends. Counting only inactive pages left 192 MiB free of a 1.5 GiB limit
    # where 1.1 GiB allocated (a real cgroup). File pages mapped into a process (weights
    # loaded with copy=False) stay used: evicting them would make every forward read them.
    key = "total_" if v1 else ""
    mapped = "total_mapped_file" if v1 else "file_mapped"
    stat = (f"anon {200 * MiB}\n{key}inactive_file {24 * MiB}\n{key}active_file {1000 * MiB}\n"
            f"{mapped} {300 * MiB}\n")
    if v1:
        _control_groups(monkeypatch, tmp_path, "4:memory:/box\n", {
            "memory/box/memory.limit_in_bytes": f"{1536 * MiB}\n",
            "memory/box/memory.usage_in_bytes": f"{1224 * MiB}\n",
            "memory/box/memory.stat": stat})
    else:
        _control_groups(monkeypatch, tmp_path, "0::/box\n", {
            "box/memory.max": f"{1536 * MiB}\n", "box/memory.current": f"{1224 * MiB}\n",
            "box/memory.stat": stat})
    # 312 MiB left, plus 24 inactive and 1000 - 300 active unmapped
    assert adaptive.cpu_memory.get_available_cpu_memory() == (312 + 24 + 700) * MiB


def test_a_limit_on_a_group_above_the_process_binds_it(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # A pod's limit over its container's group, which has none of its own.
    _control_groups(monkeypatch, tmp_path, "0::/kubepods/pod1/box\n", {
        "kubepods/pod1/memory.max": f"{512 * MiB}\n",
        "kubepods/pod1/memory.current": f"{100 * MiB}\n",
        "kubepods/pod1/box/memory.max": "max\n",
        "kubepods/pod1/box/memory.current": f"{100 * MiB}\n"})
    assert adaptive.cpu_memory.cpu_memory_info() == (412 * MiB, 512 * MiB)


def test_a_cgroup_v1_limit_counts_where_the_container_sees_its_own_group_at_the_root(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _control_groups(monkeypatch, tmp_path, "5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n", {
        "memory/memory.limit_in_bytes": f"{1024 * MiB}\n",
        "memory/memory.usage_in_bytes": f"{300 * MiB}\n",
        "memory/memory.stat": f"inactive_file 1\ntotal_inactive_file {100 * MiB}\n"})
    assert adaptive.cpu_memory.cpu_memory_info() == (824 * MiB, 1024 * MiB)


@pytest.mark.parametrize("membership, files", [
    ("0::/\n", {"memory.max": "max\n", "memory.current": "1\n"}),
    ("0::/\n", {"memory.max": "a lot\n", "memory.current": "1\n"}),
    ("0::/\n", {"memory.max": "1048576\n"}),  # no usage to read
    ("4:memory:/\n", {"memory/memory.limit_in_bytes": "9223372036854771712\n",
                      "memory/memory.usage_in_bytes": "1\n"}),  # v1's "no limit"
    ("", {}),
])
def test_without_a_readable_memory_limit_the_machines_figures_stand(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, membership: str,
        files: dict[str, str]) -> None:
    import psutil

    _control_groups(monkeypatch, tmp_path, membership, files)
    assert adaptive.cpu_memory.cpu_memory_info()[1] == psutil.virtual_memory().total
    assert adaptive.cpu_memory.get_available_cpu_memory() > 1024**2


def _meminfo_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import psutil

    def refused() -> None:
        raise PermissionError(13, "Permission denied", "/proc/meminfo")

    monkeypatch.setattr(psutil, "virtual_memory", refused)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sysconf page counts: Linux")
def test_without_psutils_reading_free_cpu_memory_comes_from_the_kernels_page_counts(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import psutil

    total = psutil.virtual_memory().total
    _control_groups(monkeypatch, tmp_path, "", {})
    _meminfo_refused(monkeypatch)
    assert 0 < adaptive.cpu_memory.get_available_cpu_memory() <= total
    assert adaptive.plan(_linears(1), devices={"cpu": "auto"}).device_map == {"": "cpu"}


def test_without_the_machines_figures_a_containers_limit_is_the_reading(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _control_groups(monkeypatch, tmp_path, "0::/\n", {
        "memory.max": f"{1024 * MiB}\n", "memory.current": f"{200 * MiB}\n"})
    _meminfo_refused(monkeypatch)
    monkeypatch.delattr(cpu_memory.os, "sysconf")  # as on Windows: no page counts
    assert adaptive.cpu_memory.cpu_memory_info() == (824 * MiB, 1024 * MiB)
    _control_groups(monkeypatch, tmp_path, "", {})
    with pytest.raises(OSError, match="free CPU memory is unknown.*capacities in bytes"):
        adaptive.cpu_memory.get_available_cpu_memory()
