"""Imported once by the fork server that starts worker processes (see ``distsgd.launch.procs.mp_context``).

Each worker forked from it starts with these modules loaded instead of importing them again:
about 2 s of CPU for torch and 1.5 s for torch._dynamo, which torch.optim imports lazily when
the first optimiser is built.
"""

import torch  # noqa: F401
import torch._dynamo  # noqa: F401
import torch.distributed  # noqa: F401

import distsgd.algorithms.registry  # noqa: F401
import distsgd.launch.group  # noqa: F401
import distsgd.launch.server  # noqa: F401
import distsgd.launch.shared  # noqa: F401
