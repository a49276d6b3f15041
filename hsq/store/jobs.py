"""Chunk jobs as RQ stores them: what a job holds, reading jobs back (untrusted), job sizes.

RQ provides the queue format (JSON-serialized jobs in `rq:queue:*` lists, visible to
`rq info`) through its public API only (Queue.prepare_data / enqueue_many, Job.fetch_many;
docs/queue.md says why). A job is a chunk of sample ids; its id ends in `-n<samples>`, which
the scripts read to move a job's count with it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
from rq.job import Job
from rq.serializers import JSONSerializer

from hsq.dataset.jsonl import IndexEntry
from hsq.store.connection import Client

JOB_FUNC = "hsq.workers.jobs.extract_chunk"
SampleRef = tuple[str, IndexEntry]
AnyRef = tuple[str, IndexEntry | str]
"""A sample and its index entry, or the entry already encoded (the producer's fast path)."""
T = TypeVar("T")
_JOB_SIZE_RE = re.compile(r"-n([0-9]{1,9})$")


@dataclass(frozen=True)
class ChunkJob:
    """A claimed job: which queue it came from and what it holds."""

    job_id: str
    origin: str
    samples: list[SampleRef]
    attempt: int
    reason: str | None


def job_size(job_id: str) -> int | None:
    """The sample count a job id carries (None for ids made before they carried one)."""
    m = _JOB_SIZE_RE.search(job_id)
    return int(m.group(1)) if m else None


def job_kwargs(
    run: str, samples: Iterable[AnyRef], attempt: int, reason: str | None
) -> dict[str, Any]:
    return {
        "run": run,
        # (id, entry) pairs as they come when the entry is encoded already: JSON writes a
        # tuple as the same array as a list.
        "samples": [r if isinstance(r[1], str) else (r[0], r[1].encode()) for r in samples],
        "attempt": attempt,
        "reason": reason,
    }


def parse_job(job: Job, queues: tuple[str, ...]) -> ChunkJob | None:
    """A ChunkJob from RQ's public Job API; None if its arguments are not ours (untrusted)."""
    try:
        kw = job.kwargs
        samples = [(str(sid), IndexEntry.decode(str(e))) for sid, e in kw["samples"]]
        attempt = kw.get("attempt", 0)
        reason = kw.get("reason")
        if not isinstance(attempt, int) or not (reason is None or isinstance(reason, str)):
            return None
    except Exception:  # rq's deserialization or a damaged payload: several types
        return None
    origin = job.origin if job.origin in queues else queues[0]
    return ChunkJob(job.id, origin, samples, attempt, reason)


def fetch_jobs(client: Client, job_ids: list[str]) -> list[Job | None]:
    """RQ's public bulk fetch; a damaged job hash (rq raises) reads as absent."""
    try:
        return Job.fetch_many(job_ids, connection=client, serializer=JSONSerializer)
    except redis.exceptions.RedisError:
        raise
    except Exception:  # one damaged job fails the batch: fetch one by one
        jobs: list[Job | None] = []
        for jid in job_ids:
            try:
                jobs += Job.fetch_many([jid], connection=client, serializer=JSONSerializer)
            except redis.exceptions.RedisError:
                raise
            except Exception:
                jobs.append(None)
        return jobs


def chunked(items: Sequence[T], size: int) -> Iterator[list[T]]:
    for i in range(0, len(items), size):
        yield list(items[i : i + size])
