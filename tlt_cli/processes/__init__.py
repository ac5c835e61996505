"""Process plumbing of `tlt train`: how the GRPO workers are started, joined and heard from.

None of it is the algorithm (tlt_cli/training/); it is what runs the algorithm in several processes,
whatever body each process runs (the caller hands the driver the trainer's):
  driver.py            `train(recipe, trainer)`: the run from its preparation to its summary
  run_preparation.py   what the driver does once first: clear what killed runs left, the drafter, the run's plan
  resume_point.py      where a resumed run starts: its checkpoint, checked, and the settings it changes
  worker_events.py     the event loop: workers started, their reports turned into trace records, a failure named
  run_trace.py         the run's trace, opened at its first record
  run_failures.py      the driver's errors and the clean-up after a failed run
  messages.py          what the driver and its workers send each other (RunSpec, WorkerSpec, WorkerStepReport, ...)
  run_directory.py     the run directory: made, locked while the run lives, removed if it fails at once
  step_deadline.py     which worker overran workers.step_timeout_s in its step
  local_workers.py     workers spawned on the driver's machine, events on a multiprocessing queue
  launched_workers.py  the driver's side of a hostfile run: the DeepSpeed launcher starts the ranks
  launched_rank.py     the entry point of one rank the DeepSpeed launcher starts (`python -m`)
  launch_files.py      what the driver leaves in the run directory for launched ranks
  hostfile.py          DeepSpeed hostfiles: parsing, checks, the launcher command
  event_channel.py     authenticated TCP channel from launched ranks to the driver
  distributed.py       process-group init (gloo / NCCL) and the rollout barrier
  op_build.py          DeepSpeed's CPU op built under a lock tlt owns, which the kernel releases when its holder dies
  machine_checks.py    does this machine have the GPUs, SGLang and /dev/shm the recipe needs
  step_records.py      the workers' step reports turned into trace records
  worker_process.py    what each worker process does first: exit with the driver, output to its log
"""
