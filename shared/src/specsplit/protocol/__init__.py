"""Sans-I/O protocol core: session state machines of both sides, no sockets, no models."""
