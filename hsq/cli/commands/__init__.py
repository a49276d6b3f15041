"""The `hsq` commands, one module per command or close group, each on shared flag records
(hsq/cli/flags.py) and the services' settings dataclasses (hsq.settings.setting):

    serve.py    serve-reference, worker, exporter      (long-running processes)
    sglang.py   launch-sglang
    vllm.py     launch-vllm
    launch.py   (the flags and launcher arguments launch-sglang and launch-vllm share)
    produce.py  tokenize, enqueue
    recover.py  recover
    status.py   status, runs
    admin.py    requeue, purge, acl
    verify.py   verify, audit
    export.py   export
    demo.py     demo
    run.py      run                                    (a node: hsq/node/)

A command parses and formats; what it decides belongs to a service or to hsq/ops/.
Heavy imports (torch, Redis, the services, structlog) stay inside the command function and
a module imports at its top only what its options are built from: `hsq X --help` starts
fast (tests/test_cli_start.py). hsq/cli/main.py names them in the `hsq` group's lazy table
(a module is imported when one of its commands is asked for); each is an `@hsq_command`
(hsq/cli/command.py: hsq's log options after it too, --help in sections).
"""
