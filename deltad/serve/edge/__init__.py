"""The gRPC edge: credentials, the request gate, the servicer and the server that wires them."""
