"""What the processes of a job settle together, through JAX's coordination service (the
key-value store that `jax.distributed.initialize` joins): one process's answer given to all
(`share`), every process's value (`gather`), and a value each process keeps posted for the
others to read (`Board`).

No device collective runs: a process that has not come yet is waited for, never met in
another collective, and a process waiting here shows it in its stack (`fleetjax-run`'s hang
report counts a wait in this module as a wait for the others). Values are JSON. With one
process everything is local.
"""

from __future__ import annotations

import collections
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

_PREFIX = "fleetjax"
_SLICE_MS = 60_000  # an unbounded wait, as blocking gets of this long
_POLL_SECONDS = (0.001, 0.05)  # a board's reader polls from the first to the second, doubling
_rounds: collections.Counter[str] = collections.Counter()  # per topic: every process counts alike


class DecisionError(RuntimeError):
    """The process that decides for all (`share`) raised; every other process raises this."""


def _client() -> Any:
    """JAX's coordination client, or None with one process."""
    if jax.process_count() == 1:
        return None
    from jax._src import distributed  # the key-value store has no public API (jax 0.10)

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError(
            f"{jax.process_count()} processes but no jax.distributed client: join them with "
            "fleet.init() (or jax.distributed.initialize) before they decide anything together"
        )
    return client


def _key(topic: str, *parts: object) -> str:
    return "/".join((_PREFIX, topic, *map(str, parts)))


def _waited(client: Any, key: str) -> Any:
    while True:
        try:
            return json.loads(client.blocking_key_value_get(key, _SLICE_MS))
        except jax.errors.JaxRuntimeError as e:
            if "DEADLINE_EXCEEDED" not in str(e):
                raise


def share(topic: str, decide: Callable[[], Any]) -> Any:
    """`decide()` as process 0 computes it, on every process (only process 0 calls it), as
    JSON gives it back (tuples as lists).

    Every process calls `share` with the same topics in the same order. If `decide` raises,
    process 0 raises it and every other process a `DecisionError` with its message.
    """
    client = _client()
    if client is None:
        return json.loads(json.dumps(decide()))
    _rounds[topic] += 1
    key = _key(topic, _rounds[topic])
    if jax.process_index() != 0:
        answer = _waited(client, key)
        if "error" in answer:
            raise DecisionError(f"process 0 failed to decide {topic}: {answer['error']}")
        return answer["value"]
    try:
        value = json.loads(json.dumps(decide()))
    except Exception as e:
        client.key_value_set(key, json.dumps({"error": f"{type(e).__name__}: {e}"}))
        raise
    client.key_value_set(key, json.dumps({"value": value}))
    return value


def gather(topic: str, value: Any) -> list[Any]:
    """Every process's `value`, in process order, on every process (each calls it with the
    same topics in the same order)."""
    client = _client()
    if client is None:
        return [json.loads(json.dumps(value))]
    _rounds[topic] += 1
    client.key_value_set(_key(topic, _rounds[topic], jax.process_index()), json.dumps(value))
    return [_waited(client, _key(topic, _rounds[topic], p)) for p in range(jax.process_count())]


class Board:
    """A value that each process keeps current for the others under `topic`: `post` hands it
    to a thread that posts the newest (or, with `now`, posts it before returning); `read`
    gives what a process posted last, or None. One key per process, overwritten."""

    def __init__(self, topic: str) -> None:
        self._topic, self._client = topic, _client()
        self._newest: Any = None
        self._lock = threading.Lock()
        self._waiting = threading.Event()
        self._thread: threading.Thread | None = None

    def post(self, value: Any, *, now: bool = False) -> None:
        if self._client is None:
            return
        text = json.dumps(value)
        if now:
            with self._lock:  # after any older value the thread is posting
                self._newest = None
                self._client.key_value_set(self._own, text, allow_overwrite=True)
            return
        self._newest = text
        self._waiting.set()
        if self._thread is None:
            self._thread = threading.Thread(target=self._keep_posting, daemon=True)
            self._thread.name = f"fleetjax-board-{self._topic}"
            self._thread.start()

    @property
    def _own(self) -> str:
        return _key(self._topic, jax.process_index())

    def _keep_posting(self) -> None:
        while self._waiting.wait():
            self._waiting.clear()
            with self._lock:
                text, self._newest = self._newest, None
                if text is not None:
                    self._client.key_value_set(self._own, text, allow_overwrite=True)

    def read(self, process: int) -> Any:
        if self._client is None:
            return None
        try:
            return json.loads(self._client.key_value_try_get(_key(self._topic, process)))
        except jax.errors.JaxRuntimeError:  # NOT_FOUND: nothing posted yet
            return None

    def wait_for(self, process: int, ready: Callable[[Any], bool]) -> Any:
        """What `process` posts first that is `ready`, waiting as long as it takes."""
        pause = _POLL_SECONDS[0]
        while not ready(posted := self.read(process)):
            time.sleep(pause)
            pause = min(2 * pause, _POLL_SECONDS[1])
        return posted
