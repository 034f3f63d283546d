"""Conformance vectors of the GetDelta pull protocol (docs/conformance.md).

* :mod:`deltad.conformance.vectors`: the on-disk format (recorded exchanges, expected state).
* :mod:`deltad.conformance.reference`: a small reference decoder and applier, independent of
  :mod:`deltad.consume`, that computes the state a vector must produce.
* :mod:`deltad.conformance.replay`: a gRPC server that replays recorded vectors to a client.
"""
