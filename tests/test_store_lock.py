"""A store's unit lock (`pmnet.store_lock`, issues 45 and 53): a dead writer's lock is
broken, a live one waited for, and no lock, unreadable, another host's or moved aside by
mistake, wedges a study."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import time
from pathlib import Path

import pytest

from pmnet import store_lock as lock
from pmnet.io import read_json
from pmnet.store_layout import StoreError, StoreLayout
from pmnet.store_lock import UnitLock


def _dead_pid() -> int:
    ctx = multiprocessing.get_context("spawn")
    p = ctx.Process(target=time.sleep, args=(0,))
    p.start()
    p.join()
    return p.pid


def test_unit_lock_breaks_a_dead_writers_lock_and_waits_for_a_live_one(tmp_path):
    store = StoreLayout(tmp_path / "store")
    path = store.lock("u")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"host": socket.gethostname(), "pid": _dead_pid(),
                                "time": time.time(), "token": "old"}))
    with UnitLock(store, "u", wait_s=5) as lock:  # the dead writer's lock is stale
        assert read_json(path)["token"] == lock.token
        with pytest.raises(StoreError, match=f"store unit u is locked by pid {os.getpid()}"):
            UnitLock(store, "u", wait_s=0.3).acquire()  # a live owner: waited for, then refused
    assert not path.exists()
    path.write_text(json.dumps({"host": "elsewhere", "pid": 1, "time": time.time() - 7200,
                                "token": "old"}))
    with UnitLock(store, "u", wait_s=5):  # another host's, older than STALE_LOCK_S
        pass



# -- a store's unit locks: none wedges a study (issue 53) -------------------------------------


def _unit_lock_file(tmp_path: Path, content: bytes, age_s: float) -> tuple:
    store = StoreLayout(tmp_path / "store")
    path = store.lock("u")
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return store, path


UNREADABLE = {"empty": b"", "truncated": b'{"host": "vm", "pid": 12', "not JSON": b"\x00\xffzz",
              "a JSON list": b"[1, 2]", "an object without its time": b'{"pid": 1}'}


@pytest.mark.parametrize("content", list(UNREADABLE.values()), ids=list(UNREADABLE))
def test_an_unreadable_unit_lock_is_stale_once_its_file_is_older_than_the_threshold(
        tmp_path, content):
    """A writer that died between creating its lock and writing it (or a damaged lock file)
    left a lock no one can read: stale once its mtime is older than STALE_LOCK_S, taken at
    once then; a young one is waited for (it may be a writer between create and write)."""
    store, path = _unit_lock_file(tmp_path, content, age_s=lock.STALE_LOCK_S + 5)
    t0 = time.time()
    with UnitLock(store, "u", wait_s=30) as held:
        assert json.loads(path.read_text())["token"] == held.token
    assert time.time() - t0 < 2 and not path.exists()
    assert not list(path.parent.iterdir())  # the stale one is gone, not left aside
    path.write_bytes(content)  # young: a live writer's, for all we know
    with pytest.raises(StoreError, match=r"store unit u is locked by pid .* a lock older than "
                       r"600 s is stale \(its recorded time, or its file's age"):
        UnitLock(store, "u", wait_s=0.3).acquire()
    assert path.read_bytes() == content


def test_the_stale_threshold_is_configurable_and_an_empty_lock_breaks_after_it(tmp_path,
                                                                              monkeypatch):
    """PMNET_STALE_LOCK_S=1.5: a fresh empty lock wedges a writer no longer than 1.5 s (plus
    its polling); an unusable value keeps the default."""
    store, path = _unit_lock_file(tmp_path, b"", age_s=0)
    monkeypatch.setenv(lock.STALE_LOCK_ENV, "1.5")
    assert lock.stale_lock_s() == 1.5
    t0 = time.time()
    with UnitLock(store, "u", wait_s=30) as held:
        waited = time.time() - t0
        assert json.loads(path.read_text())["token"] == held.token
    assert 1.4 < waited < 4, waited
    for bad in ("", "x", "-3", "0"):
        monkeypatch.setenv(lock.STALE_LOCK_ENV, bad)
        assert lock.stale_lock_s() == lock.STALE_LOCK_S


def test_another_hosts_unit_lock_is_judged_by_age_alone(tmp_path):
    """A lock of another host names a pid that means nothing here: neither a dead pid nor a
    live one of this host decides, its recorded time does."""
    young = {"host": "elsewhere", "pid": 999_999_999, "time": time.time(), "token": "t"}
    store, path = _unit_lock_file(tmp_path, json.dumps(young).encode(), age_s=0)
    assert not lock.unit_lock_stale(path, young, 600)  # the pid is dead here: not judged
    with pytest.raises(StoreError, match="locked by pid 999999999 on elsewhere"):
        UnitLock(store, "u", wait_s=0.3).acquire()
    old = {**young, "time": time.time() - 601}
    path.write_text(json.dumps(old))
    os.utime(path)  # a fresh mtime does not make it young: its recorded time decides
    assert lock.unit_lock_stale(path, old, 600)
    with UnitLock(store, "u", wait_s=5):
        pass


def test_a_fresh_lock_moved_aside_by_mistake_goes_back(tmp_path):
    """Two writers judge one stale lock; the first takes it, the second moves the first's
    fresh lock aside: `same_stale_lock` says it is not the judged one (its token; an
    unreadable one by its young mtime), so it goes back."""
    store, path = _unit_lock_file(tmp_path, b"", age_s=0)
    assert not lock.same_stale_lock(path, None, 600)  # unreadable but young
    os.utime(path, (time.time() - 700, time.time() - 700))
    assert lock.same_stale_lock(path, None, 600)
    path.write_text(json.dumps({"host": "h", "pid": 1, "time": time.time(), "token": "b"}))
    assert not lock.same_stale_lock(path, None, 600)  # written since: another writer's
    judged = {"host": "h", "pid": 1, "time": 0.0, "token": "a"}
    assert not lock.same_stale_lock(path, judged, 600)
    assert lock.same_stale_lock(path, {**judged, "token": "b"}, 600)
