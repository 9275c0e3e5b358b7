#!/usr/bin/env python3
"""Development TLS certificates for deploy/nats-server.conf: see services/dev_certs.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.dev_certs import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
