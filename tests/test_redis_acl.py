"""Per-run isolation in Redis, with a real redis-server and the ACL users
`hsq acl --run R` prints: one run's credentials do the whole run and cannot read, rewrite,
delete or list another run's keys. And a worker refuses an `out` that changed under it
without a new run generation."""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import redis

from hsq.keys import RunKeys, rq_job_key, rq_queue_key
from hsq.node.procs import ManagedProcess, free_port
from hsq.producer.synthetic import write_synthetic
from hsq.store import connect, consumer_client
from tests.helpers import enqueue, hsq, log_events, start_worker, store, wait_until
from tests.support.procs import ReferenceServer

Factory = Callable[..., ReferenceServer]
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    """A redis-server whose ACL file holds `hsq acl` users for runs a and b, and an admin."""
    d = tmp_path_factory.mktemp("acl")
    users = [hsq("acl", "--run", r, check=True).stdout.strip() for r in ("a", "b", "c", "d")]
    lines = [u.replace("><PASSWORD>", f">pw-{u.split()[1]}") for u in users]
    (d / "users.acl").write_text("user default on >admin ~* &* +@all\n" + "\n".join(lines) + "\n")
    port = free_port()
    (d / "redis.conf").write_text(
        f'port {port}\nbind 127.0.0.1\ndir {d}\nsave ""\nappendonly no\naclfile {d}/users.acl\n'
    )
    srv = ManagedProcess(["redis-server", str(d / "redis.conf")], d / "redis.log")
    admin = redis.Redis(port=port, password="admin")
    deadline = time.monotonic() + 20
    while True:
        try:
            admin.ping()
            break
        except redis.exceptions.ConnectionError:
            if time.monotonic() > deadline or not srv.alive():
                srv.stop()
                pytest.fail(f"redis-server did not start:\n{srv.log_tail()}")
            time.sleep(0.1)
    yield port, d
    srv.stop()


def url(port: int, run: str | None) -> str:
    auth = f"hsq-{run}:pw-hsq-{run}" if run else ":admin"
    return f"redis://{auth}@127.0.0.1:{port}/0"


def test_the_doc_shows_the_acl_user_hsq_acl_prints() -> None:
    text = (ROOT / "docs/operations.md").read_text()
    assert RunKeys("R").acl_user() in text


def test_one_runs_user_does_the_whole_run_and_nothing_to_another_run(
    tmp_path: Path, acl_redis: tuple[int, Path], server_factory: Factory
) -> None:
    port, _ = acl_redis
    ds = tmp_path / "d.jsonl"
    write_synthetic(ds, 8, seed=21, min_len=4, max_len=16)
    out = tmp_path / "out"
    env = {**os.environ, "HSQ_REDIS_URL": url(port, "a")}

    def as_a(*args: str) -> str:
        return hsq(*args, env=env, check=True).stdout

    # Run b (its own user) and run a-b (admin), whose key names start like run a's.
    enqueue(ds, "b", out, url(port, "b"), "--chunk-size", "4")
    enqueue(ds, "a-b", out, url(port, None), "--chunk-size", "4")
    # The whole of run a as user hsq-a.
    as_a("enqueue", str(ds), "--run", "a", "--out", str(out), "--no-progress")
    server = server_factory(name="aclsrv").wait_ready()
    w = start_worker(tmp_path, "a", server, url(port, "a"), "--burst")
    assert w.proc.wait(180) == 0, w.log_tail()
    assert json.loads(as_a("status", "--run", "a", "--json"))["done"] == 8
    as_a("verify", "--run", "a", "--deep", "--no-progress")
    as_a("requeue", "--run", "a", "--failed")
    as_a("recover", "--run", "a", "--no-progress")
    # A stream consumer names its connections (`hsq run` waits for attached ones): allowed.
    assert connect(url(port, "a"), name=consumer_client("a")).ping()

    a = redis.Redis.from_url(url(port, "a"))
    admin = redis.Redis.from_url(url(port, None), decode_responses=True)
    kb, kab = RunKeys("b"), RunKeys("a-b")
    b_job = str(admin.lrange(rq_queue_key(kb.main_queue), 0, 0)[0])
    ab_job = str(admin.lrange(rq_queue_key(kab.main_queue), 0, 0)[0])
    b_out = admin.hget(kb.config, "out")
    denied: list[Callable[[], object]] = [
        lambda: a.hset(kb.config, "out", json.dumps("/tmp/attacker")),  # the issue's attack
        lambda: a.delete(kb.done),
        lambda: a.hgetall(kb.config),
        lambda: a.hgetall(kb.index),
        lambda: a.lrange(rq_queue_key(kb.main_queue), 0, -1),
        lambda: a.lpush(rq_queue_key(kb.retry_queue), "x"),
        lambda: a.hgetall(rq_job_key(b_job)),
        lambda: a.hgetall(rq_job_key(ab_job)),  # `hsq-a-b-...` starts like run a's jobs
        lambda: a.lrange(rq_queue_key(kab.main_queue), 0, -1),
        lambda: a.hgetall(kab.config),
        lambda: a.scan(0),  # would list every key name
        lambda: a.keys("*"),
        lambda: a.smembers("hsq:runs"),
        lambda: a.smembers("rq:queues"),
        lambda: a.flushall(),
        lambda: a.config_get("*"),
        lambda: a.eval("return 1", 0),
        lambda: a.client_list(),  # would show every client's address and name
    ]
    for i, attempt in enumerate(denied):
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()
        assert admin.hget(kb.config, "out") == b_out, i
    assert admin.hlen(kb.index) == 8 and admin.exists(kb.config)
    res = hsq("status", "--run", "b", env=env)
    assert res.returncode == 3 and "permission" in res.stderr, res.stderr
    as_a("purge", "--run", "a", "--yes")
    assert not [k for k in admin.scan_iter("hsq:run:a:*")]
    assert admin.exists(kb.config) and admin.exists(kab.config)


def test_one_runs_user_can_neither_hide_nor_poison_another_runs_listing(
    tmp_path: Path, acl_redis: tuple[int, Path]
) -> None:
    """Run c's user attacks the run listings. Old code: `SREM hsq:runs d` hid run d
    from `hsq runs`, `hsq status` and the exporter, `SREM rq:queues` from `rq info`, and a
    hostile `SADD hsq:runs` entry made `hsq runs` and `hsq status` exit 2. Now the listing is
    each run's own config key (found by SCAN): c's user has no access to the shared sets,
    and whatever it plants under its own prefix is skipped and reported, never fatal."""
    from rq import Queue

    from hsq.ops.prometheus import RedisCollector

    port, _ = acl_redis
    ds = tmp_path / "d.jsonl"
    write_synthetic(ds, 4, seed=23, min_len=4, max_len=8)
    admin = redis.Redis.from_url(url(port, None), decode_responses=True)
    enqueue(ds, "d", tmp_path / "out", url(port, "d"))
    enqueue(ds, "c", tmp_path / "out", url(port, "c"))
    enqueue(ds, "e", tmp_path / "out", url(port, None))  # by the admin: RQ's registry has it
    c = redis.Redis.from_url(url(port, "c"))
    kd = RunKeys("d")
    attacks: list[Callable[[], object]] = [
        lambda: c.srem("hsq:runs", "d"),
        lambda: c.srem("rq:queues", rq_queue_key(kd.main_queue)),
        lambda: c.sadd("hsq:runs", "bad name\n", "ghost"),
        lambda: c.sadd("rq:queues", "junk"),
        lambda: c.delete("rq:queues"),
    ]
    for attack in attacks:
        with pytest.raises(redis.exceptions.NoPermissionError):
            attack()
    # What c's user can do: keys under its own prefix that look like run configs. The
    # legacy `hsq:runs` (hsq 0.2.0's listing, no longer read) holds junk too.
    c.hset("hsq:run:c:x:config", "run", '"x"')
    c.hset("hsq:run:c:bad name\n:config", "run", '"x"')
    admin.sadd("hsq:runs", "bad name\n", "ghost")
    env = {**os.environ, "HSQ_REDIS_URL": url(port, None)}
    try:
        runs = hsq("runs", env=env)
        assert runs.returncode == 0, runs.stderr
        listed = [line.split()[0] for line in runs.stdout.splitlines()]
        assert {"d", "e"} <= set(listed) and "ghost" not in listed, runs.stdout
        assert "skipped: 'hsq:run:c:x:config'" in runs.stderr, runs.stderr
        assert "'hsq:run:c:bad name\\n:config'" in runs.stderr, runs.stderr
        status = hsq("status", "--json", env=env)
        assert status.returncode == 0, status.stderr
        shown = {json.loads(line)["run"] for line in status.stdout.splitlines()}
        assert {"c", "d", "e"} <= shown and "ghost" not in shown
        assert "skipped: 'hsq:run:c:x:config'" in status.stderr, status.stderr
        metrics = list(RedisCollector(redis.Redis.from_url(url(port, None))).collect())
        exported = {s.labels.get("run") for m in metrics for s in m.samples}
        assert {"c", "d", "e"} <= exported
        skipped = [s.value for m in metrics for s in m.samples if m.name == "hsq_runs_skipped"]
        assert skipped == [2.0], skipped  # the two key names that are not a run's
        # RQ's own registry (rq info reads it) holds the admin's run, and RQ can read it.
        assert rq_queue_key(RunKeys("e").main_queue) in admin.smembers("rq:queues")
        assert "hsq-e" in {q.name for q in Queue.all(connection=admin)}
    finally:
        for key in admin.scan_iter("hsq:run:[cde]:*"):
            admin.delete(key)
        admin.delete("hsq:runs")


def test_run_names_that_would_share_a_queue_are_refused() -> None:
    with pytest.raises(ValueError, match="retry queue"):
        RunKeys("a-retry")
    assert hsq("acl", "--run", "a-retry").returncode == 2


def test_acl_key_patterns_match_each_run_and_no_other() -> None:
    import fnmatch

    runs = ["a", "a-b", "ab", "a_b", "b-a", "a-bcdefghijklmnopq"]
    keys = {r: RunKeys(r) for r in runs}
    token = "0123456789abcdef"
    for r, k in keys.items():
        mine = [
            k.config,
            k.done,
            k.wip("w.1"),
            rq_queue_key(k.main_queue),
            rq_queue_key(k.retry_queue),
            rq_job_key(k.job_id(token, 16)),
        ]
        for other, ok in keys.items():
            # Redis globs: `[..]` classes and `*`, which fnmatch reads the same way.
            hits = [
                x for x in mine if any(fnmatch.fnmatchcase(x, p) for p in ok.acl_key_patterns())
            ]
            assert hits == (mine if other == r else []), (r, other, hits)


# The name that broke the old job patterns: a legal run name holding another run's job-id
# shape.
TRICKY = [
    "qa",
    "qa-0123456789abcdef-nightly",
    "qa-0123456789abcdef-n8",
    "qa-0123456789abcdef-n",
    "0123456789abcdef-n000000001",
    "n5",
    "x-n5",
    "qa_",
    "a",
    "a-b",
]
_ALPHABET = "ab0123456789cdef-_nqx"


def _legal_names(rng: random.Random, count: int) -> list[str]:
    """Legal run names biased toward job-id material: hex runs, `-n`, digits."""
    names = set(TRICKY)
    pieces = ["0123456789abcdef", "-n", "-n8", "-", "qa", "_", "retry", "9" * 9, "n"]
    while len(names) < count:
        parts = [rng.choice(pieces) if rng.random() < 0.5 else rng.choice(_ALPHABET)
                 for _ in range(rng.randint(1, 6))]  # fmt: skip
        name = "".join(parts)[:64]
        try:
            RunKeys(name)
        except ValueError:
            continue
        names.add(name)
    return sorted(names)


def _keys_of(k: RunKeys, rng: random.Random) -> list[str]:
    token = "".join(rng.choice("0123456789abcdef") for _ in range(16))
    return [
        k.config,
        k.done,
        k.wip("w.1"),
        k.worker("w.1"),
        rq_queue_key(k.main_queue),
        rq_queue_key(k.retry_queue),
        *(rq_job_key(k.job_id(token, n)) for n in (1, 8, 16, 4096, 123456789, 999999999)),
    ]


def test_no_legal_run_names_key_matches_another_legal_runs_patterns() -> None:
    """As a property over legal names (seeded fuzz plus the crafted ones above): every
    key of run R matches R's patterns, and no key of any other legal run does."""
    import fnmatch

    rng = random.Random(33)
    names = _legal_names(rng, 300)
    keys = {r: _keys_of(RunKeys(r), rng) for r in names}
    pats = {r: RunKeys(r).acl_key_patterns() for r in names}
    for r in names:
        for other in names:
            # Redis globs: `[..]` classes and `*`, which fnmatch reads the same way.
            hits = [x for x in keys[other] if any(fnmatch.fnmatchcase(x, p) for p in pats[r])]
            assert hits == (keys[r] if other == r else []), (r, other, hits)


def test_redis_itself_keeps_the_issues_run_out_of_another_runs_job_keys(
    acl_redis: tuple[int, Path],
) -> None:
    """The same with Redis's own matcher (ACL DRYRUN) over users `hsq acl` prints: the
    HGETALL/HSET/EXPIRE/DEL of `qa-0123456789abcdef-nightly`'s job hash as run qa's user,
    and a sample of the fuzzed names."""
    port, _ = acl_redis
    admin = redis.Redis.from_url(url(port, None), decode_responses=True)
    rng = random.Random(34)
    names = [*TRICKY, *rng.sample(_legal_names(rng, 120), 30)]
    printed = hsq("acl", "--run", "qa", "--user", "fz-qa", check=True).stdout.strip()
    assert printed == RunKeys("qa").acl_user("fz-qa")
    for r in names:
        head, _, selector = RunKeys(r).acl_user(f"fz-{r}").partition(" (")
        rules = ["reset", *head.split()[2:], *(["(" + selector] if selector else [])]
        admin.execute_command("ACL", "SETUSER", f"fz-{r}", *rules)  # type: ignore[no-untyped-call]
    try:
        asked = []
        p = admin.pipeline(transaction=False)
        for r in names:
            for other in names:
                for key in _keys_of(RunKeys(other), rng):
                    for cmd in (["HGETALL", key], ["HSET", key, "f", "v"], ["DEL", key]):
                        p.execute_command("ACL", "DRYRUN", f"fz-{r}", *cmd)  # type: ignore[no-untyped-call]
                        asked.append((r, other, cmd))
        for (r, other, cmd), said in zip(asked, p.execute(), strict=True):
            assert (said == "OK") == (r == other), (r, other, cmd, said)
    finally:
        for r in names:
            admin.execute_command("ACL", "DELUSER", f"fz-{r}")  # type: ignore[no-untyped-call]


def test_a_worker_refuses_an_out_changed_under_it_without_a_new_generation(
    tmp_path: Path, server_factory: Factory, redis_url: str
) -> None:
    """With the run's credentials one could rewrite its `out`; the worker then wrote to the
    new path. Now it stops (exit 2), hands its work back, and writes nothing there."""
    server = server_factory(name="tampersrv").wait_ready()
    ds = tmp_path / "d.jsonl"
    write_synthetic(ds, 40, seed=22, min_len=4, max_len=16)
    out, attacker = tmp_path / "out", tmp_path / "attacker"
    enqueue(ds, "tamper", out, redis_url, "--chunk-size", "2")
    rules = [{"mode": "slow", "seconds": 0.1, "prob": 1.0}]
    httpx.post(server.url + "/admin/faults", json={"rules": rules}).raise_for_status()
    st = store(redis_url, "tamper")
    w = start_worker(tmp_path, "tamper", server, redis_url, "--reap-interval", "0.3")
    try:
        wait_until(lambda: st.count(st.keys.done) >= 2, timeout=120)
        redis.Redis.from_url(redis_url).hset(st.keys.config, "out", json.dumps(str(attacker)))
        assert w.proc.wait(60) == 2, w.log_tail()
    finally:
        w.stop()
        httpx.delete(server.url + "/admin/faults").raise_for_status()
    assert not attacker.exists()
    assert log_events(w.log_path, "run_config_changed_refused")
    done = st.count(st.keys.done)
    assert done == len(list((out / "tamper").rglob("*.safetensors"))) and done < 40
    assert st.queue_lengths()["main"] > 0  # the rest is handed back, not lost
