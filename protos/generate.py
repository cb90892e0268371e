"""Regenerate the committed Python code for protos/ (run by `make protos`).

The generated modules are committed under ace_common/proto/ so that neither the gateway
nor the agent needs grpcio-tools at run time. protoc writes absolute imports
(`from ace.agent.v1 import agent_pb2`); they are rewritten to package-relative ones.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent
OUT = ROOT.parent / "ace_common" / "proto"
PROTOS = ["ace/agent/v1/agent.proto"]


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    for proto in PROTOS:
        rc = protoc.main(["protoc", f"-I{ROOT}", f"--python_out={OUT}", f"--pyi_out={OUT}",
                          f"--grpc_python_out={OUT}", str(ROOT / proto)])
        if rc != 0:
            return rc
    for path in OUT.rglob("*.py*"):
        text = path.read_text()
        fixed = re.sub(r"^from ace\.agent\.v1 import", "from ace_common.proto.ace.agent.v1 import",
                       text, flags=re.M)
        if fixed != text:
            path.write_text(fixed)
    for pkg in [OUT, OUT / "ace", OUT / "ace" / "agent", OUT / "ace" / "agent" / "v1"]:
        (pkg / "__init__.py").touch()
    return 0


if __name__ == "__main__":
    sys.exit(main())
