"""Stand-in for verl.workers.rollout.utils (tests/verl/standin/README.md)."""


async def ensure_async_iterator(iterable):
    if hasattr(iterable, "__aiter__"):
        async for item in iterable:
            yield item
    else:
        for item in iterable:
            yield item
