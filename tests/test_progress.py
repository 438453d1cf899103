"""The progress display off a terminal: a line per tenth of the work, with the time left."""

import io
import re

from normkit.progress import Progress


def test_a_line_per_tenth_with_an_estimate_of_the_time_left():
    stream = io.StringIO()
    progress = Progress("conformance", 5, stream=stream)
    progress.add(15)  # the total may grow once a worker says how many devices it sees
    for i in range(20):
        progress.advance(f"case {i}")
    progress.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 10
    assert re.fullmatch(r"conformance: 2/20, \d+ s, about \d+ s left \(case 1\)", lines[0])
    assert re.fullmatch(r"conformance: 20/20, \d+ s, about 0 s left \(case 19\)", lines[-1])
