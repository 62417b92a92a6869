"""When the pool starts kernels: never beside a running rollout in "idle" mode (the default), behind each taken
kernel in "eager" mode, on demand when none is warm; booting kernels at a low priority, running ones at the host's."""

from __future__ import annotations

import asyncio
import dataclasses
import os

import pytest

from sandbox import KernelPool, Limits, run_sync
from sandbox.kernel import KernelProcess, KernelStartError
from sandbox.limits import is_root

LIMITS = Limits(wall_s=5.0, uid_base=150000)


def niceness_of_uid(uid: int) -> set[int]:
    """The niceness of every live process of ``uid`` (field 19 of /proc/PID/stat)."""
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    with open(f"/proc/{entry}/stat") as f:
                        out.add(int(f.read().rsplit(")", 1)[1].split()[16]))
            except OSError:
                pass
    return out


async def episodes(pool: KernelPool, n: int, then: str = "21 * 2") -> list[str]:
    """``n`` episodes at once, each on its own kernel; each also checks that no kernel boots while it runs."""
    async def one() -> str:
        async with pool.acquire() as kernel:
            result = await kernel.execute(then, mode="single")
            await asyncio.sleep(0.2)  # the other episodes are running too: a refill now would boot beside them
            return result.output
    return await asyncio.gather(*(one() for _ in range(n)))


def test_idle_refill_boots_only_when_no_kernel_is_in_use():
    async def main() -> None:
        async with KernelPool(size=3, limits=LIMITS) as pool:
            assert pool.boots == 3 and pool.boots_while_busy == 0
            assert await episodes(pool, 3) == ["42\n"] * 3
            assert pool.boots_while_busy == 0, "a kernel booted while episodes ran"
            # the last release started the refill: the pool comes back to full strength by itself
            for _ in range(600):
                if pool.warm == 3:
                    break
                await asyncio.sleep(0.05)
            assert pool.warm == 3 and pool.boots == 6
            assert await episodes(pool, 3) == ["42\n"] * 3  # the second rollout finds warm kernels
            assert pool.boots_while_busy == 0
    run_sync(main())


def test_more_episodes_than_warm_kernels_start_theirs_on_demand():
    async def main() -> None:
        async with KernelPool(size=2, limits=LIMITS) as pool:
            assert await episodes(pool, 5) == ["42\n"] * 5
            assert pool.boots_while_busy == 3  # exactly the three the warm set lacked
    run_sync(main())


def test_eager_refill_boots_behind_each_taken_kernel():
    async def main() -> None:
        async with KernelPool(size=2, limits=LIMITS, refill="eager") as pool:
            assert await episodes(pool, 2) == ["42\n"] * 2
            assert pool.boots_while_busy == 2
    run_sync(main())


def test_bad_refill_mode_is_refused():
    with pytest.raises(ValueError, match="refill"):
        KernelPool(size=1, refill="lazy")  # type: ignore[arg-type]


@pytest.mark.skipif(not is_root(), reason="kernels get uids of their own (and are reniced) only when the host is root")
def test_kernels_boot_at_low_priority_and_run_at_the_hosts():
    async def main() -> None:  # kernels that boot a Python of their own (a fork of the fork server is cheap: nice 0)
        async with KernelPool(size=1, limits=dataclasses.replace(LIMITS, fork_server=False)) as pool:
            host = os.nice(0)
            warm = pool._idle[0]
            assert niceness_of_uid(warm.uid) == {host + 10}  # booted (and waiting) 10 below the host's priority
            async with pool.acquire() as kernel:
                assert (await kernel.execute("import os; print(os.nice(0))")).output == f"{host}\n"
                assert niceness_of_uid(kernel._proc.uid) == {host}
    run_sync(main())


def test_kernels_are_released_when_the_hosts_descriptors_run_above_1023():
    # vLLM raises the soft RLIMIT_NOFILE and a pool of 128 kernels holds over a thousand descriptors: nothing in the
    # sandbox may wait on a descriptor with select() (it refuses those above 1023)
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the hard limit on open files ({hard}) is below 1200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    filler = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]
    try:
        async def main() -> None:
            async with KernelPool(size=2, limits=LIMITS) as pool:
                assert await episodes(pool, 2) == ["42\n"] * 2
        run_sync(main())
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# ---------------------------------------------------------------------------------------------------------------
# An acquire never waits forever: a boot that fails or a kernel taken by a later acquire leaves no waiter behind.
# (Real kernels; the hook only wraps KernelProcess.start to make the one moment happen on purpose.)


async def one_episode(pool: KernelPool) -> str:
    async with pool.acquire() as kernel:
        return (await kernel.execute("6 * 7", mode="single")).output


def test_an_acquire_whose_boot_fails_gets_the_next_one(monkeypatch):
    real, fail = KernelProcess.start, [True]

    async def start(self: KernelProcess) -> KernelProcess:
        if fail:  # the first boot after the warm start fails, as one does under load (a 60 s start timeout)
            fail.pop()
            self.kill()
            raise KernelStartError("sandboxed kernel did not start (injected)")
        return await real(self)

    async def main() -> None:
        async with KernelPool(size=1, limits=LIMITS) as pool:
            monkeypatch.setattr(KernelProcess, "start", start)
            async with pool.acquire():  # the warm kernel is in use: the next acquire boots its own
                assert await asyncio.wait_for(one_episode(pool), 90) == "42\n"
            assert not fail and pool.failures == 1
    run_sync(main())


def test_a_kernel_taken_by_a_later_acquire_while_a_boot_hands_it_over_leaves_no_waiter_behind(monkeypatch):
    real, hook, late = KernelProcess.start, [], []

    async def start(self: KernelProcess) -> KernelProcess:
        proc = await real(self)
        if hook:  # an acquire that starts in the same turn of the loop as this boot's hand-over
            late.append(asyncio.ensure_future(one_episode(hook.pop())))
        return proc

    async def main() -> None:
        async with KernelPool(size=1, limits=LIMITS) as pool:
            monkeypatch.setattr(KernelProcess, "start", start)
            async with pool.acquire():  # the warm kernel is in use: nothing refills, each acquire boots its own
                hook.append(pool)
                first = await asyncio.wait_for(asyncio.gather(one_episode(pool), one_episode(pool)), 90)
                assert late, "the hook did not run"
                assert first + [await asyncio.wait_for(late[0], 90)] == ["42\n"] * 3
    run_sync(main())


def test_persistent_boot_failures_reach_the_acquire_as_an_error(monkeypatch):
    async def start(self: KernelProcess) -> KernelProcess:
        self.kill()
        raise KernelStartError("sandboxed kernel did not start (injected)")

    async def main() -> None:
        async with KernelPool(size=1, limits=LIMITS) as pool:
            monkeypatch.setattr(KernelProcess, "start", start)
            async with pool.acquire():
                with pytest.raises(KernelStartError, match="injected"):
                    await asyncio.wait_for(one_episode(pool), 90)
    run_sync(main())


def test_a_cancelled_acquire_leaves_its_kernel_to_the_next_one():
    async def main() -> None:
        async with KernelPool(size=1, limits=LIMITS) as pool:
            async with pool.acquire():  # the warm kernel is in use: the next acquire boots its own
                waiting = asyncio.ensure_future(one_episode(pool))
                await asyncio.sleep(0.05)
                assert pool.boots == 2  # its boot is on its way
                waiting.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await waiting
                assert await asyncio.wait_for(one_episode(pool), 90) == "42\n"
                assert pool.boots == 2, "the cancelled acquire's kernel went to the next one, not a new boot"
    run_sync(main())
