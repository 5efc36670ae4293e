"""Reusable helpers for tests that run real sockets and processes on loopback."""
