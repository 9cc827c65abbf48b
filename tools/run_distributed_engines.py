#!/usr/bin/env python
"""Run an ssl_engine job: compose the config, check it, and launch the processes.

    python tools/run_distributed_engines.py config=quick/simclr_digits config.CHECKPOINT.DIR=/tmp/run

Arguments are hydra overrides (config=..., config.A.B=v, +config.A.NEW=v) plus:
  node_id=K   this machine's index in a multi-node job (default 0)
  --debug     show tracebacks of user errors (or set SSL_ENGINE_DEBUG=1)
"""

import sys

from ssl_engine.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], tool_process=True))
