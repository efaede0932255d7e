"""CPU numerics for every process that runs the models: imported by each module that does torch math.

Attention probabilities and their products underflow into denormal floats, which x86 CPUs process
up to ~40x slower (measured: a tiny-target forward took 0.96 s instead of 0.025 s). Flushing them
to zero changes values by < 1e-38 and only affects CPU math. The setting is per thread: it holds
in the thread that imports the models (the rank's main thread, a test's, the eval process's).
"""

import torch

torch.set_flush_denormal(True)
