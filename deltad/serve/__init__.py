"""The deltad sidecar (`deltad serve`): segment log, window merge, offsets, gRPC service."""
