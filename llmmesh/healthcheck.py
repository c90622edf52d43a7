"""`python -m llmmesh.healthcheck HOST:PORT`: exit 0 when grpc.health.v1 says SERVING (for containers)."""
from __future__ import annotations

import asyncio
import sys

from llmmesh.server import wait_serving


def main() -> int:
    address = sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:50051"
    try:
        asyncio.run(wait_serving(address, timeout_s=2.0))
    except TimeoutError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
