"""Unit tests: in-process, no child processes, no servers; each runs in well under a second."""
