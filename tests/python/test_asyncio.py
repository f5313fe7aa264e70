"""The asyncio forms: the event loop keeps running while refit works, and
cancellation reaches the C++ operation."""

import asyncio
import time

import numpy as np
import pytest

import refit
from conftest import connect


def test_the_loop_keeps_ticking_during_a_1_gib_receive():
    gib = 1 << 30
    src = {f"shard.{i}": np.full(gib // 4 // 4, i + 1, dtype=np.float32) for i in range(4)}
    dest = {k: np.zeros_like(v) for k, v in src.items()}
    sender = refit.Sender("tcp", timeout_ms=60000)
    engine = refit.Engine("tcp", timeout_ms=60000, tensors=dest)
    connect(sender, [engine])
    meta = refit.describe(src)

    async def main():
        gaps = []
        done = asyncio.Event()

        async def ticker():
            last = time.monotonic()
            while not done.is_set():
                await asyncio.sleep(0.001)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        start = time.monotonic()
        await asyncio.gather(sender.send_weights_async(src, meta), engine.receive_async(meta))
        elapsed = time.monotonic() - start
        done.set()
        await tick
        return elapsed, gaps

    elapsed, gaps = asyncio.run(main())
    for k in src:
        assert dest[k][0] == src[k][0] and dest[k][-1] == src[k][-1]
    assert engine.fingerprint(["shard.3"]) == refit.fingerprints(src, ["shard.3"])
    # Sleeping 1 ms per tick, the loop ran all along: ticks cover the transfer and
    # none waited long (the GIL is held only to hand results back).
    assert len(gaps) > elapsed / 0.01, f"{len(gaps)} ticks in {elapsed:.2f} s"
    assert max(gaps) < 0.25, f"the asyncio loop stalled {max(gaps) * 1000:.0f} ms"
    sender.shutdown()


def test_cancelling_the_awaiting_task_cancels_the_cpp_operation():
    sender = refit.Sender("tcp", timeout_ms=30000)
    sender.prepare({"master_address": "127.0.0.1", "master_port": 0, "world_size": 2})

    async def main():
        task = asyncio.create_task(sender.connect_workers_async())  # no worker ever comes
        await asyncio.sleep(0.2)
        start = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return time.monotonic() - start

    assert asyncio.run(main()) < 1.0
    sender.shutdown()


def test_async_errors_keep_their_kinds_and_python_exceptions_stay_themselves():
    src = {"w": np.arange(100, dtype=np.float32)}

    class Refused(Exception):
        pass

    def load(batch):
        raise Refused("no")

    sender = refit.Sender("tcp", timeout_ms=5000)
    engine = refit.Engine("tcp", timeout_ms=5000, framework="numpy")
    connect(sender, [engine])
    meta = refit.describe(src)

    async def main():
        with pytest.raises(refit.InvalidStateError):
            await engine.finish_weight_update_async(1)
        engine.start_weight_update()
        send = asyncio.ensure_future(sender.send_weights_async(src))
        await engine.update_weights_async(meta, load)
        with pytest.raises(Refused):
            await engine.finish_weight_update_async(1)
        await send

    asyncio.run(main())
    assert engine.weights_dirty
    sender.shutdown()


def test_many_concurrent_async_calls():
    # 8 engines initialised and updated at once from one asyncio loop.
    src = {f"t{i}": np.full(1000, i, dtype=np.int32) for i in range(20)}
    dests = [{k: np.zeros_like(v) for k, v in src.items()} for _ in range(8)]
    engines = [refit.Engine("tcp", timeout_ms=20000, tensors=d) for d in dests]
    sender = refit.Sender("tcp", timeout_ms=20000)
    info = sender.prepare({"master_address": "127.0.0.1", "master_port": 0, "world_size": 9})
    meta = refit.describe(src)

    async def main():
        await asyncio.gather(sender.connect_workers_async(),
                             *[e.init_async(dict(info, rank_offset=1 + i)) for i, e in enumerate(engines)])
        for _ in range(3):
            await asyncio.gather(sender.send_weights_async(src), *[e.receive_async(meta) for e in engines])

    asyncio.run(main())
    for d in dests:
        assert all((d[k] == src[k]).all() for k in src)
    sender.shutdown()
