"""The caching host allocator (kernels/csrc/host_cache.cpp): reuse, and shedding idle blocks of other sizes.

Each check runs in a fresh interpreter: enabling the cache replaces the process's CPU allocator for good.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from zlightning.kernels import _ext

pytestmark = pytest.mark.skipif(not _ext.available(), reason="native kernels not built")

_SCRIPT = textwrap.dedent(
    """
    import json, torch
    from zlightning.kernels._host_cache import enable_host_cache, host_cache_stats

    def rss_anon():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("RssAnon:"))

    MIB = 1 << 20
    assert enable_host_cache()
    out = {}
    a = torch.empty(4 * MIB // 4).fill_(1.0)  # a unit-sized block, touched
    del a                                     # idle and resident
    s0, r0 = host_cache_stats(), rss_anon()
    b = torch.empty(2 * MIB // 4).fill_(1.0)  # another size: the idle 4 MiB block cannot serve it
    s1, r1 = host_cache_stats(), rss_anon()
    out["miss"] = s1.misses - s0.misses
    out["shed_first"] = s1.shed_bytes - s0.shed_bytes
    out["rss_growth_first"] = r1 - r0
    del b
    c = torch.empty(4 * MIB // 4).fill_(2.0)  # the 4 MiB block again: its pages come back, the 2 MiB one goes
    s2 = host_cache_stats()
    out["hit_again"] = s2.hits - s1.hits
    out["miss_again"] = s2.misses - s1.misses
    out["shed_second"] = s2.shed_bytes - s1.shed_bytes
    out["values_ok"] = bool((c == 2.0).all())
    del c
    d = torch.empty(4 * MIB // 4)             # its resident block again: no page faults, so nothing is shed
    s3 = host_cache_stats()
    out["resident_reuse"] = (s3.hits - s2.hits, s3.shed_bytes - s2.shed_bytes)
    print(json.dumps(out))
    """
)


def test_idle_blocks_of_another_size_are_shed_not_kept_resident() -> None:
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    mib = 1 << 20
    assert out["miss"] == 1, out
    # exactly the 2 MiB that would lift resident bytes past the 4 MiB high-water mark: half the idle block's pages
    assert out["shed_first"] == 2 * mib, out
    # mapping 2 MiB while dropping 2 MiB: resident memory holds (kept resident, it would have grown by 2 MiB)
    assert out["rss_growth_first"] < mib, out
    assert out["hit_again"] == 1 and out["miss_again"] == 0, out  # the half-dropped block is reused, still mapped
    assert out["shed_second"] == 2 * mib, out
    assert out["values_ok"], out
    assert out["resident_reuse"] == [1, 0], out


_BELOW_PEAK = textwrap.dedent(
    """
    import json, torch
    from zlightning.kernels._host_cache import empty_host_cache, enable_host_cache, host_cache_stats

    MIB = 1 << 20
    assert enable_host_cache()
    peak = [torch.empty(4 * MIB // 4).fill_(1.0) for _ in range(3)]  # 12 MiB live at once: the high-water mark
    del peak
    empty_host_cache()
    s0 = host_cache_stats()
    for _ in range(3):  # phases of other sizes, 10 MiB together: below the mark, so nothing needs dropping
        small = [torch.empty(2 * MIB // 4).fill_(2.0) for _ in range(3)]
        del small
        big = torch.empty(4 * MIB // 4).fill_(3.0)
        del big
    s1 = host_cache_stats()
    over = [torch.empty(4 * MIB // 4).fill_(4.0) for _ in range(3)]  # 12 MiB live with 6 MiB idle resident
    s2 = host_cache_stats()
    print(json.dumps({"shed_below": s1.shed_bytes - s0.shed_bytes, "misses_below": s1.misses - s0.misses,
                      "shed_over": s2.shed_bytes - s1.shed_bytes}))
    """
)


def test_idle_blocks_stay_resident_below_the_live_high_water_mark() -> None:
    """Phases that alternate sizes keep each other's idle blocks while live plus resident idle bytes stay within the
    most ever live (no re-faulting churn); past it, idle blocks of other sizes are dropped."""
    done = subprocess.run([sys.executable, "-c", _BELOW_PEAK], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["misses_below"] == 4 and out["shed_below"] == 0, out  # mapped once each, then reused resident
    assert out["shed_over"] >= 4 * (1 << 20), out  # 12 MiB live again: the 2 MiB blocks' pages had to go


_OLDEST_FIRST = textwrap.dedent(
    """
    import json, resource, torch
    from zlightning.kernels._host_cache import enable_host_cache, host_cache_stats

    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    MIB = 1 << 20
    assert enable_host_cache()
    old = torch.empty(5 * MIB // 4).fill_(1.0)
    new = torch.empty(3 * MIB // 4).fill_(1.0)  # 8 MiB live: the high-water mark
    del old                                     # idle first: the longest idle
    del new
    s0 = host_cache_stats()
    small = torch.empty(MIB // 4).fill_(1.0)    # a third size, 1 MiB past the mark
    s1 = host_cache_stats()
    f0 = faults()
    a = torch.empty(3 * MIB // 4).fill_(2.0)    # the recently freed block: still wholly resident
    f1 = faults()
    b = torch.empty(5 * MIB // 4).fill_(3.0)    # the oldest block: its last MiB comes back
    f2 = faults()
    print(json.dumps({"shed": s1.shed_bytes - s0.shed_bytes, "recent_faults": f1 - f0, "oldest_faults": f2 - f1,
                      "values_ok": bool((a == 2.0).all() and (b == 3.0).all() and (small == 1.0).all())}))
    """
)


def test_only_the_bytes_needed_are_dropped_from_the_longest_idle_block() -> None:
    """Past the high-water mark by 1 MiB, exactly 1 MiB of pages goes, from the block idle the longest: the block
    freed more recently is reused without a page fault, the older one faults back only its dropped MiB."""
    done = subprocess.run([sys.executable, "-c", _OLDEST_FIRST], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    pages_per_mib = (1 << 20) // 4096
    assert out["shed"] == 1 << 20, out
    assert out["recent_faults"] < pages_per_mib // 8, out
    assert pages_per_mib // 2 <= out["oldest_faults"] <= 2 * pages_per_mib, out
    assert out["values_ok"], out


_UNDER_A_DATA_LIMIT = textwrap.dedent(
    """
    import json, resource, torch
    from zlightning.kernels._host_cache import empty_host_cache, enable_host_cache, host_cache_stats

    def vm_data():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmData:"))

    MIB = 1 << 20
    assert enable_host_cache()
    out = {}
    a = torch.empty(8 * MIB // 4).fill_(1.0)
    del a                                      # 8 MiB idle, resident: the high-water mark
    s0 = host_cache_stats()
    c = torch.empty(12 * MIB // 4).fill_(2.0)  # 4 MiB past the mark: all 8 MiB of the idle block's pages must go
    s1 = host_cache_stats()
    out["mapped_growth"] = (s1.mapped_bytes - s0.mapped_bytes) // MIB
    del c
    peak = [torch.empty(16 * MIB // 4).fill_(3.0) for _ in range(3)]
    del peak
    empty_host_cache()                         # nothing mapped, a mark of 48 MiB
    x, y = torch.empty(16 * MIB // 4).fill_(3.0), torch.empty(16 * MIB // 4).fill_(3.0)
    del x, y                                   # 32 MiB idle, below the mark: kept resident, nothing to shed
    s2 = host_cache_stats()
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (vm_data() + 4 * MIB, hard))
    try:
        d = torch.empty(10 * MIB // 4).fill_(4.0)  # another class: a new 10 MiB mapping, over a 4 MiB allowance
        out["mapped_change"] = (host_cache_stats().mapped_bytes - s2.mapped_bytes) // MIB
        out["fits"] = bool((d == 4.0).all())
    except RuntimeError as err:
        out["fits"] = str(err)[:200]
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
    print(json.dumps(out))
    """
)


def test_under_a_data_limit_idle_blocks_give_way() -> None:
    """See [Note: address space under a data limit]: a block that shedding emptied is unmapped, and when the process's
    data limit refuses a new mapping, idle blocks are unmapped to make room instead of the allocation failing."""
    done = subprocess.run([sys.executable, "-c", _UNDER_A_DATA_LIMIT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["mapped_growth"] == 12 - 8, out  # the 12 MiB block mapped, the emptied 8 MiB block unmapped
    assert out["fits"] is True, out
    assert out["mapped_change"] == 10 - 16, out  # one idle 16 MiB block (the longest idle) made room
