"""`python -m llmmesh.healthcheck HOST:PORT [ROLE]`: exit 0 when grpc.health.v1 says SERVING (for
containers). With a ROLE (router, worker, costd; gateway when its port serves TLS) the check goes
over TLS as the mesh's admin identity from LLMMESH_TLS_DIR, expecting that role's certificate."""
from __future__ import annotations

import asyncio
import sys

from llmmesh.identity import Role
from llmmesh.mtls import MeshIdentity, MissingIdentity
from llmmesh.server import wait_serving


def main() -> int:
    address = sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:50051"
    try:
        role = Role(sys.argv[2]) if len(sys.argv) > 2 else None
        caller = MeshIdentity.from_env(Role.ADMIN) if role else None
        asyncio.run(wait_serving(address, timeout_s=2.0, caller=caller, server_role=role))
    except (TimeoutError, ValueError, MissingIdentity) as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
