import logging
import os
import sys

from distsgd.cli import main

code = main()
if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
    # Under torchrun, leave without C++ static destructors: about once in ten runs on this VM a
    # gloo/c10d thread still joinable at interpreter exit aborted a finished worker ("terminate
    # called without an active exception", SIGABRT, no Python frame), and torchrun then failed
    # the whole run. Everything the run writes is closed by now.
    from multiprocessing import util

    run_finalizers = util._run_finalizers  # type: ignore[attr-defined]  # private: typeshed leaves it out
    run_finalizers(0)  # Python's own clean-ups that os._exit would skip: the semaphores of the
    run_finalizers()  # run's locks and events (else reported leaked), temporary folders
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
raise SystemExit(code)
