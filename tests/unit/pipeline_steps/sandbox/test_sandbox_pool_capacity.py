"""The local sandbox server's capacity, through the real SDK: ``--max-sandboxes`` sandboxes can be held at once
(also while the warm pool refills, whose sandbox being started holds a slot), the next create is refused as the SDK
reads a full service (503, ``ServiceBusyException``), and ``GET /health`` reports the capacity for the pre-flight."""

from __future__ import annotations

import asyncio

import httpx
import pytest

pytestmark = pytest.mark.needs_root(reason="the sandbox server needs root (uids, namespaces)")

CAPACITY = 3


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from pipeline_steps.sandbox.launcher import LocalSandboxServer

    args = ["--warm", "1", "--max-sandboxes", str(CAPACITY)]
    with LocalSandboxServer(tmp_path_factory.mktemp("sandboxes") / "state", args=args) as srv:
        yield srv


def _health(server) -> dict:
    return httpx.get(f"{server.url}/health", timeout=10).json()


async def _wait_warm(server, timeout: float = 30.0):
    for _ in range(int(timeout / 0.05)):
        if _health(server)["warm"] >= 1:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the warm pool did not fill")


@pytest.mark.parametrize("attempt", range(3))
def test_capacity_is_max_sandboxes_also_while_the_warm_pool_refills(server, attempt):
    from e2b.exceptions import ServiceBusyException
    from e2b_code_interpreter import AsyncSandbox

    assert _health(server)["capacity"] == CAPACITY

    async def main():
        await _wait_warm(server)
        # at once: the first takes the warm sandbox and starts a refill, which takes a slot; the last create finds no
        # slot free and no warm sandbox yet
        held = await asyncio.gather(
            *[AsyncSandbox.create(**server.sdk_options()) for _ in range(CAPACITY)], return_exceptions=True
        )
        try:
            refused = [h for h in held if isinstance(h, BaseException)]
            assert refused == [], refused
            assert _health(server)["running"] == CAPACITY
            with pytest.raises(ServiceBusyException, match=f"all {CAPACITY} sandboxes are in use"):
                await AsyncSandbox.create(**server.sdk_options())
            values = await asyncio.gather(*[sb.run_code(f"{i} * 2") for i, sb in enumerate(held)])
            assert [v.results[0].text for v in values] == [str(i * 2) for i in range(CAPACITY)]
        finally:
            await asyncio.gather(*[sb.kill() for sb in held if not isinstance(sb, BaseException)])

    asyncio.run(main())
    assert _health(server)["running"] == 0
