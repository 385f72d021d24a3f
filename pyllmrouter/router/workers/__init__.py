"""The router's side of the worker processes, and what lives beside them on the host.

    handle      WorkerHandle: one worker process, its pipe (typed messages), heartbeat, death
    sets        WorkerSet: the worker of each device set, started on demand, given back when empty
    conduit     a worker's native data path (client connections handed over, their answers counted)
    measure     probes and fits run in a worker masked like the target one
    keep        prompt states kept across eviction (files in RAM and on disk)

Processes, sockets and files: everything here does I/O, outside the scheduler's lock.
"""
