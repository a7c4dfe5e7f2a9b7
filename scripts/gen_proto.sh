#!/usr/bin/env bash
# Regenerate the gRPC/protobuf modules from gateway/protocol/control.proto (needs grpcio-tools).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. gateway/protocol/control.proto
