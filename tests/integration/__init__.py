"""Integration tests: real worker and sidecar processes, loopback HTTP servers, multi-process gloo, the
operator against the kmock API emulator."""
