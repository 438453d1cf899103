"""A worker that reports its pid, then sleeps past any test's patience."""

import os
import time

from normkit import workers


def _sleep(job: object, emit: workers.Emit) -> None:
    emit({"pid": os.getpid()})
    time.sleep(120)


if __name__ == "__main__":
    workers.serve(_sleep)
