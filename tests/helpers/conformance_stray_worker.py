"""A conformance worker that prints a line on its stdout before it starts serving events."""

from normkit import workers
from normkit.conformance.worker import run_job

if __name__ == "__main__":
    print("a stray line before the first event")  # noqa: T201 - what the parent must survive
    workers.serve(run_job)
