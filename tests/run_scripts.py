"""Run by `tests.torchrun.torchrun_scripts` under torchrun: several check scripts in one launch, in turn.

Each script runs as `__main__` with its own argv, as if launched alone, in the
same processes: torch, megatron-core and the gloo group start once for all of
them (about 20 s of a 4-process launch on 2 cores). argv[1] is a JSON list of
{"script": path below the repo, "args": [...], "stdout": path or null (where
rank 0's prints go)}.
"""
import contextlib
import json
import os
import runpy
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(spec: str) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    # Python put this file's directory (tests/) first on the path, where tests/kernels would shadow the
    # `kernels` package transformers probes for (ImportError on `import transformers`).
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
    sys.path.insert(0, REPO)
    from hybridflow.engine import cpu_compat

    cpu_compat.apply()  # before any script imports megatron-core (engine/cpu_compat.py)
    rank = int(os.environ["RANK"])
    for entry in json.loads(spec):
        sys.argv = [entry["script"], *entry["args"]]
        stdout = entry.get("stdout") if rank == 0 else None
        with open(stdout, "w") if stdout else contextlib.nullcontext(sys.stdout) as out, \
                contextlib.redirect_stdout(out):
            started = time.perf_counter()
            try:
                runpy.run_path(os.path.join(REPO, entry["script"]), run_name="__main__")
            except SystemExit as exc:
                if exc.code not in (0, None):
                    raise
        if rank == 0:  # on stderr, which a failed launch shows: where a slow launch spent its time
            print(f"run_scripts: {entry['script']} {time.perf_counter() - started:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1])
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()  # every rank's scripts are done
        dist.destroy_process_group()
    # Leave without the interpreter's and C++ static destructors: under load, gloo's threads torn down at
    # exit aborted a rank now and then ("terminate called without an active exception", SIGABRT) after every
    # result was written (seen in a full-suite run on 2 busy cores, with the static-decode check). The atexit
    # handlers do run: multiprocessing's stops the processes dist_checkpointing's saver started, which would
    # otherwise outlive the rank holding torchrun's output pipes open (the launch never ends).
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
