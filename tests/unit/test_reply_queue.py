"""The order of a turn's bindings on the client's one reply queue (``contracts.replies``),
over a stand-in for the broker's queue whose binds and unbinds take as long as the test says:
a handle closed while its turn's binding is being made has it removed once made, a turn
followed again while its binding goes ends bound, and a closing client drops what is under
way."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import pytest
from aio_pika.abc import AbstractRobustChannel, AbstractRobustQueue

from contracts.replies import ReplyQueue


class SlowQueue:
    """Records each bind and unbind once it is done; each waits for ``release``."""

    name = "loopwire-client.test"

    def __init__(self) -> None:
        self.done: list[tuple[str, str]] = []
        self.release = asyncio.Event()
        self.failing = 0
        """How many of the next unbinds fail (the connection lost meanwhile)."""

    async def bind(self, exchange: str, key: str, **_: Any) -> None:
        await self.release.wait()
        self.done.append(("bind", key))

    async def unbind(self, exchange: str, key: str, **_: Any) -> None:
        await self.release.wait()
        if self.failing:
            self.failing -= 1
            raise ConnectionError("the connection was lost")
        self.done.append(("unbind", key))


class Ready:
    async def ready(self) -> None:
        return None


def replies_over(queue: SlowQueue) -> ReplyQueue:
    return ReplyQueue(cast(AbstractRobustChannel, Ready()), cast(AbstractRobustQueue, queue))


def handle(turn_id: str) -> Any:
    return SimpleNamespace(turn_id=turn_id)


async def following(*turn_ids: str) -> tuple[SlowQueue, ReplyQueue, list[Any]]:
    """A queue that answers at once, and a handle of each turn id following on it."""
    queue = SlowQueue()
    queue.release.set()
    replies = replies_over(queue)
    handles = [handle(turn_id) for turn_id in turn_ids]
    for one in handles:
        await replies.follow(one, f"*.*.*.{one.turn_id}")
    return queue, replies, handles


async def settled() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


async def test_a_turn_closed_while_bound_and_followed_again_ends_bound() -> None:
    queue = SlowQueue()
    replies = replies_over(queue)
    first, second = handle("t1"), handle("t1")

    following = asyncio.create_task(replies.follow(first, "*.*.*.t1"))
    await asyncio.sleep(0)
    replies.leave(first)  # while its bind is under way: removed once made
    again = asyncio.create_task(replies.follow(second, "*.*.*.t1"))  # while that goes
    await asyncio.sleep(0)
    queue.release.set()
    await asyncio.gather(following, again, return_exceptions=True)
    await settled()

    assert queue.done == [("bind", "*.*.*.t1"), ("unbind", "*.*.*.t1"), ("bind", "*.*.*.t1")]
    assert replies.following == 1


async def test_a_close_returns_at_once_and_the_binding_goes_behind() -> None:
    queue, replies, (one,) = await following("t1")
    queue.release.clear()

    replies.leave(one)
    assert replies.following == 0
    assert queue.done == [("bind", "*.*.*.t1")]
    queue.release.set()
    await settled()

    assert queue.done == [("bind", "*.*.*.t1"), ("unbind", "*.*.*.t1")]


async def test_a_closing_client_drops_what_is_under_way() -> None:
    queue = SlowQueue()
    replies = replies_over(queue)
    following = asyncio.create_task(replies.follow(handle("t1"), "*.*.*.t1"))
    await asyncio.sleep(0)

    replies.shut()

    with pytest.raises(RuntimeError, match="closed"):
        await following
    with pytest.raises(RuntimeError, match="closed"):
        await replies.follow(handle("t2"), "*.*.*.t2")
    queue.release.set()
    await settled()
    assert queue.done == []


async def test_two_handles_of_one_turn_share_its_binding() -> None:
    queue, replies, (first, second) = await following("t1", "t1")

    replies.leave(first)
    await settled()
    assert queue.done == [("bind", "*.*.*.t1")]
    replies.leave(second)
    replies.leave(second)  # closed twice: nothing more
    await settled()

    assert queue.done == [("bind", "*.*.*.t1"), ("unbind", "*.*.*.t1")]


async def test_a_binding_whose_removal_failed_is_removed_once_the_channel_is_back() -> None:
    queue, replies, (one, other) = await following("t1", "t2")
    queue.failing = 2

    replies.leave(one)
    replies.leave(other)
    await settled()
    await replies.follow(handle("t2"), "*.*.*.t2")  # t2 is followed again meanwhile
    await replies._unbind_stale()  # the channel's reopening (aio-pika restored both)

    assert queue.done == [
        ("bind", "*.*.*.t1"),
        ("bind", "*.*.*.t2"),
        ("bind", "*.*.*.t2"),
        ("unbind", "*.*.*.t1"),
    ]
    await replies._unbind_stale()
    assert len(queue.done) == 4  # removed once
