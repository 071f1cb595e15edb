"""Imported once by the fork server that starts worker processes (see ``launch.mp_context``).

Each worker forked from it starts with these modules loaded instead of importing them again:
about 2 s of CPU for torch and 1.5 s for torch._dynamo, which torch.optim imports lazily when
the first optimiser is built.
"""

import torch  # noqa: F401
import torch._dynamo  # noqa: F401
import torch.distributed  # noqa: F401
import torch.distributed.rpc  # noqa: F401

import distsgd.launch  # noqa: F401
import distsgd.train.loop  # noqa: F401
