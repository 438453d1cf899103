"""Test configuration shared by every test file."""

import importlib.util
import os

from hypothesis import settings

# Property tests explore a fixed, seeded set of examples, so a run is reproducible and CI never
# fails on a draw no one can replay; set HYPOTHESIS_PROFILE=explore to draw new examples.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# TensorFlow and Triton each carry their own LLVM: importing Triton after TensorFlow aborts the
# process ("Option ... registered more than once"), while the other order works. Tests of every
# backend share one pytest process (and transformers imports Triton), so Triton goes first.
# Without a GPU the Triton kernels run in Triton's interpreter, which triton reads at import.
if importlib.util.find_spec("triton") is not None:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton  # noqa: F401
