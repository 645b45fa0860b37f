"""The benchmark harness: jax_kda's backends beside the peer KDA implementations.

Entry points: ``python -m benchmarks.run`` (measure) and ``python -m benchmarks.report`` (rebuild
the markdown table and the plot from a results JSON). See ``benchmarks/README.md``.
"""

import os

# JAX and torch share the GPU in one process: JAX must not take 75% of it up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
