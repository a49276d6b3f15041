"""The dump protocol: the one contract between an inference server and a worker.

- :mod:`hsq.dump.format`: the layout, names and meta.json schema (DumpMeta, ModelIdentity,
  fingerprint, expected_shapes).
- :mod:`hsq.dump.write`: write_dump, the one writer every server uses.
- :mod:`hsq.dump.read`: reading one dump against what was sent (Expected, check_meta,
  open_dump_tensors, read_dump).
- :mod:`hsq.dump.find`: the one dump finder (scan_by_rid, scan, wait_for_dump,
  clear_dump_dir).
- :mod:`hsq.dump.ready`: the readiness marker (ReadyMarker, write_ready, read_ready).

The worker attributes dumps to its in-flight requests with hsq.workers.send.ridmatch; the
shared tensor names, dtypes and encodings are hsq.states'. docs/dump-protocol.md is the
prose version; `hsq` re-exports the names a server author needs (write_dump, read_dump, ...).
"""
