"""Who builds a shared cache entry, decided by Ray: one named actor per sweep grants a lease per entry.

The driver starts the actor on its own node (`start_leases`), so it lives as long as the sweep and is not lost with
a worker node; each trial finds it by the sweep's cache folder (`RayLeases.of_sweep`) and implements
`storage.cache.Leases` with it. Rules:
- an entry has at most one holder; the others wait on the actor and are told as soon as it is stored;
- a holder renews its lease while it builds; one whose node has died (Ray's node table) or that has not renewed
  for `lapse_s` loses it, and the next trial to ask takes over;
- the actor remembers what was stored; after a restart (a new cluster) the storage itself says so.
Cross-node coordination therefore never rests on file locks, which some network filesystems fake.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from taylor_tune.jsonio import digest

LAPSE_S = 30.0  # a holder silent this long has lost its lease (it renews every storage heartbeat, 5 s)
WAIT_S = 10.0  # how long one `acquire` waits on the actor for news before answering "wait"
NODES_S = 1.0  # how old the actor's view of the live nodes may be


NAMESPACE = "taylor_tune"  # named actors are found within a namespace: the driver's, its trials', a notebook's


def actor_name(cache_dir: str) -> str:
    return f"taylor_tune_leases_{digest(cache_dir)[:16]}"


@ray.remote(num_cpus=0)
class LeaseGranter:
    """The sweep's lease table (see the module's docstring). Async: a waiting `acquire` holds no thread."""

    def __init__(self, lapse_s: float = LAPSE_S):
        self.lapse_s = lapse_s
        self.holders: dict[str, dict] = {}
        self.stored: set[str] = set()
        self.news: dict[str, asyncio.Event] = {}
        self.log: list[dict] = []  # every grant, takeover and store: what tests and benchmarks count
        self._alive: set[str] = set()
        self._alive_at = -1.0

    def _node_alive(self, node: str) -> bool:
        if time.monotonic() - self._alive_at > NODES_S:
            self._alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
            self._alive_at = time.monotonic()
        return node in self._alive

    def _lost(self, held: dict) -> bool:
        return time.monotonic() - held["renewed"] > self.lapse_s or not self._node_alive(held["node"])

    def _grant(self, key: str, holder: dict, event: str) -> str:
        self.holders[key] = {**holder, "renewed": time.monotonic()}
        self.log.append({"event": event, "key": key, "node": holder["node"], "time": time.time()})
        return event

    async def acquire(self, key: str, holder: dict, wait_s: float = WAIT_S, again: bool = False) -> str:
        """"granted" / "takeover" (build it), "stored" (read it) or "wait" (after up to `wait_s` with no news)."""
        if again:  # told stored, yet the caller found no entry (or a damaged one): the next holder builds it
            self.stored.discard(key)
        deadline = time.monotonic() + wait_s
        while True:
            if key in self.stored:
                return "stored"
            held = self.holders.get(key)
            if held is None or held["id"] == holder["id"]:
                return self._grant(key, holder, "granted")
            if self._lost(held):
                return self._grant(key, holder, "takeover")
            left = deadline - time.monotonic()
            if left <= 0:
                return "wait"
            news = self.news.setdefault(key, asyncio.Event())
            try:  # woken by the release; else a second later, to look at the holder's node again
                await asyncio.wait_for(news.wait(), timeout=min(left, 1.0))
            except TimeoutError:
                pass

    async def renew(self, key: str, holder: dict) -> bool:
        held = self.holders.get(key)
        if held is None or held["id"] != holder["id"]:
            return False
        held["renewed"] = time.monotonic()
        return True

    async def release(self, key: str, holder: dict, stored: bool) -> None:
        held = self.holders.get(key)
        if held is not None and held["id"] == holder["id"]:
            del self.holders[key]
        if stored:
            self.stored.add(key)
            self.log.append({"event": "stored", "key": key, "node": holder["node"], "time": time.time()})
        news = self.news.pop(key, None)
        if news is not None:
            news.set()

    async def state(self) -> dict:
        """The holders now, what is stored, and the log (for tests, benchmarks and `status`)."""
        return {"holders": {key: dict(held) for key, held in self.holders.items()}, "stored": sorted(self.stored),
                "log": list(self.log)}


def start_leases(cache_dir: str, lapse_s: float = LAPSE_S):
    """The sweep's lease actor, on this (the driver's) node: a worker node's loss does not take it along. The
    handle must be kept while the sweep runs (an actor without handles is collected)."""
    here = ray.get_runtime_context().get_node_id()
    return LeaseGranter.options(
        name=actor_name(cache_dir), namespace=NAMESPACE, get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
    ).remote(lapse_s)


class RayLeases:
    """`storage.cache.Leases` of one trial, through the sweep's lease actor."""

    def __init__(self, actor, wait_s: float = WAIT_S):
        self.actor, self.wait_s = actor, wait_s
        self.holder = {"id": uuid.uuid4().hex, "node": ray.get_runtime_context().get_node_id(),
                       "host": socket.gethostname(), "pid": os.getpid()}

    @classmethod
    def of_sweep(cls, cache_dir: str) -> RayLeases | None:
        """The leases of the sweep whose cache folder is `cache_dir`; None when no actor grants them (a trial run
        outside a sweep's driver)."""
        try:
            return cls(ray.get_actor(actor_name(cache_dir), namespace=NAMESPACE))
        except ValueError:
            return None

    def acquire(self, name: str, *, again: bool = False) -> str:
        return ray.get(self.actor.acquire.remote(name, self.holder, self.wait_s, again))

    def renew(self, name: str) -> None:
        ray.get(self.actor.renew.remote(name, self.holder))

    def release(self, name: str, *, stored: bool) -> None:
        ray.get(self.actor.release.remote(name, self.holder, stored))
