"""The runtime's internal sizes, in one typed place (as Ray Data keeps its own in ``DataContext``).

These are buffers and defaults of the runtime, not capabilities of a model kind: what a flavor
knows about its own model (``transfer_rows``, ``cpu_call_rows``) stays on its ``Flavor``. Each
field says why it has its value; the modules read ``TUNING.<field>`` instead of constants of
their own, so a size is changed (or a test shrinks one) in one place.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tuning:
    """Sizes the runtime uses where neither the job nor the model kind decides."""

    # rows per model call when JobSpec.max_batch_rows is unset and the kind declares no CPU size
    # of its own: sized for text models and GPU memory
    call_rows: int = 256
    # bytes of input per batch handed to a replica, at most: bounds a replica's memory per batch
    transfer_bytes: int = 32 << 20
    # rows per batch scored in the driver: the batches in flight bound the driver's memory, and
    # this size keeps a batch's fixed cost (checks, Arrow to numpy) small
    driver_batch_rows: int = 16_384
    # rows per batch in the driver when the model takes concurrent one-thread calls: such a call
    # waits for no other thread, and XGBoost spends less CPU per row in longer calls
    concurrent_batch_rows: int = 65_536
    # a part written in the driver is closed and the next one opened past this many bytes
    part_bytes: int = 512 << 20
    # batches waiting between the driver's reader and the model, and the model and the writer:
    # more held memory and was no faster
    queue_batches: int = 2
    # ids checked at once when InputSpec.id_column is checked unique: a larger input is split by
    # hash into spilled partitions of about this many ids, so the check's memory stays the same
    # whatever the input's size (2M int64 ids are 16 MiB; sorting them takes about twice that)
    id_check_rows_per_partition: int = 2_000_000
    # ids matched at once by RESUME's done set: the kept parts' ids and the input's are split by
    # hash into spilled partitions of about this many rows each, so finding the rows left to score
    # holds the same memory whatever the rows already scored (the same size as the uniqueness
    # check's partitions, for the same reason)
    resume_rows_per_partition: int = 2_000_000
    # keys matched at once by incremental scoring: the earlier run's keys and the input's are split
    # by hash into spilled partitions of about this many rows each, so finding the reusable rows
    # holds the same memory whatever either run's size. Half the other checks' size: a partition
    # holds both runs' rows, each about 130 bytes while matched (key, place, copies and the hash
    # join's table), so 1M rows a side stay under 300 MiB
    reuse_rows_per_partition: int = 1_000_000
    # input bytes one read task of the actor pool takes: Ray Data packs row groups into read tasks of
    # up to this much (its own default is 128 MiB), and a read task's block, the replica's output of
    # it and the write task that gets it are each about that size. Each of those workers holds a few
    # such blocks in its heap and in the object store pages it touched, and keeps that memory while
    # Ray keeps it for the next task, so this size, not the input's files, bounds the job's memory:
    # files of 1M rows and more filled 128 MiB read tasks, and the job's peak grew with its input.
    # Each read task's rows go to one part, so this also sizes the parts (a few MiB of Parquet each)
    read_task_bytes: int = 16 << 20
    # input bytes one read task takes, at most, when the replicas read their own input (a CPU job:
    # runtime/engine/pool_dataset.py): the block then stays in the replica's heap, two at a time, and only
    # the scored rows go through the object store, so a larger block costs no worker a larger
    # footprint, and Ray's scheduling, the write tasks and the parts' files (one per read task) are
    # paid a quarter as often. An input with less than two such blocks per replica is cut smaller,
    # down to read_task_bytes, so every replica gets work
    replica_read_task_bytes: int = 64 << 20
    # input bytes whose scored rows one write task of the actor pool writes as one part, when the
    # parts' rows are free to group (no JobSpec.rows_per_part, no incremental keys): Ray Data then
    # hands a write task blocks until it has that many rows. A write task costs Ray and Ray Data more
    # CPU than writing its Parquet, CPU the replicas beside it lose (docs/performance.md, the actor
    # pool), and users read fewer, larger parts. The blocks wait in the
    # object store until their task starts, so an output much wider than the model's input columns
    # (embeddings of short texts) holds a few times this much there
    write_task_bytes: int = 128 << 20
    # an actor-pool input of at most this many files and bytes (uncompressed, its footers' row groups)
    # is read in the runtime's driver and handed to Ray Data as one in-memory block
    # (runtime/inputs/small_input.py): on a cold cluster the file path's listing task, footer-reading actor
    # and read task are three more Ray worker processes to start, which on a small machine take the
    # CPU the replica needs to import its model library. The bytes stay below read_task_bytes, so the
    # file path would read such an input as one block too: rows and parts come out the same. The
    # files bound how many footers the driver opens before it knows the input is not small
    driver_read_bytes: int = 8 << 20
    driver_read_files: int = 64


#: the sizes every module of the runtime reads
TUNING = Tuning()
