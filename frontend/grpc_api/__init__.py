"""The public gRPC API (pagedserve.v1.Generation) over the streaming core."""
